"""FedAgent's experiment matrix as runs of this project: ``python -m fedagent_flwr.experiments``.

FedAgent's paper configs (its ``tools/verl08_migration/gen_paper_configs.py``) are 176 runs in four
families: ``uniform`` (4 backbones x {3 seeds, centralized, 3 local clients} x {GRPO, PPO} x
{WebShop, ALFWorld}), ``env_heterogeneity`` (WebShop's environment-level arms), ``task_heterogeneity``
(preference, coverage and hardness at two strengths) and ``decentralized`` (one protocol knob
varied: E and T, goals per client, clients per round). Here each run is a ``conf/experiment/paper_*``
preset plus the overrides that make it that run, so the matrix is data rather than 176 files. The
command prints every entry with its key settings and its ``flwr run`` line (``--json`` for
scripts); ``tests/test_experiments.py`` composes every entry and checks the composed run has the
settings printed here. Entries are named by FedAgent's config paths, so each maps to its source.

Errors are one line on stderr naming the option to fix, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedagent_flwr.cli import one_line_parser, print_output, program
from fedagent_flwr.schema.run import ALGORITHMS

#: FedAgent's paper protocol (``gen_paper_configs.py``: N, M, T, E, goals per client; base seed).
TOTAL, PER_ROUND, ROUNDS, EPOCHS, MIN_GOALS, SEED = 100, 2, 70, 3, 100, 42
#: The uniform table's backbones; the first is the only one of the other families.
BACKBONES = ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
             "meta-llama/Llama-3.2-3B-Instruct")
ENVS = ("webshop", "alfworld")
FAMILIES = ("uniform", "env_heterogeneity", "task_heterogeneity", "decentralized")
#: Env instances a step plays and rollouts each (the presets' n_envs and trainer.rollout_n): 64
#: episodes a step either way.
STEP_SHAPE = {"grpo": (8, 8), "ppo": (64, 1)}
#: GPUs of one client's verl job (the presets' trainer.n_gpus_per_node), handed over by Flower.
GPUS_PER_CLIENT = 4
#: WebShop's BM25 top-K: FedAgent raised it for the environment-level arms only.
SEARCH_RETURN_N = {"env_heterogeneity": 200}
DEFAULT_SEARCH_RETURN_N = 50
#: The key of E local epochs (replaying the round's instances); the presets set FedAgent's E = 3.
EPOCHS_KEY = "train.epochs"
#: Where hardness labels are looked for unless --labels-dir says otherwise (the WebShop download
#: puts its file there; copy ALFWorld's there too).
DEFAULT_LABELS_DIR = "${env.data_dir}/hardness"
LABELS_FILE = "qwen2.5-1.5b_{env}_trajectories.json"

_UNIFORM_SETTINGS: tuple[tuple[str, dict[str, int]], ...] = (
    ("main", {}), ("main_seed1", {"seed": 21}), ("main_seed2", {"seed": 84}),
    ("centralized", {"total": 1, "per_round": 1}),
    ("local_client1", {"per_round": 1, "local_client_id": 21}),
    ("local_client2", {"per_round": 1, "local_client_id": 42}),
    ("local_client3", {"per_round": 1, "local_client_id": 84}),
)
# (algorithm, FedAgent's directory name, partition strategy, knobs, FedAgent's file-name suffix)
_ENV_HET: tuple[tuple[str, str, str, dict[str, float], str], ...] = tuple(
    [("grpo", "catalog_split", "catalog_split", {"env_div": d, "keep_ratio": 0.7}, f"catalog_split_div-{d}_keep-0.7")
     for d in (0.0, 0.3, 0.7, 1.0)]
    + [("ppo", "catalog_split", "catalog_split", {"env_div": 1.0, "keep_ratio": 0.7}, "catalog_split_div-1.0_keep-0.7")]
    + [(algo, directory, strategy, {"variant_n": n}, f"{directory}_N-{n}")
       for directory, strategy, grpo_ns in (("bm25_reweighting", "bm25_reweight", (4, 8)),
                                            ("field_subset_index", "bm25_field_subset", (4, 8)),
                                            ("lookalike_injection", "lookalike", (2, 4)),
                                            ("rank_wrapper", "rank_wrapper", (4,)))
       for algo, n in [*(("grpo", n) for n in grpo_ns), ("ppo", 4)]]
)
_TASK_HET: tuple[tuple[str, dict[str, float], str], ...] = (
    ("preference", {"omega": 0.01}, "preference_omega-0.01"), ("preference", {"omega": 0.99}, "preference_omega-0.99"),
    ("coverage", {"size_std": 1}, "coverage_std-1"), ("coverage", {"size_std": 256}, "coverage_std-256"),
    ("hardness", {"success_std": 1}, "hardness_success_std-1"),
    ("hardness", {"success_std": 256}, "hardness_success_std-256"),
)
# family -> [(M, T, E, goals per client)]: each varies one knob of the protocol
_DECENTRALIZED: tuple[tuple[str, tuple[tuple[int, int, int, int], ...]], ...] = (
    ("ep_per_round_change", ((PER_ROUND, 210, 1, MIN_GOALS), (PER_ROUND, 42, 5, MIN_GOALS))),
    ("samples_change", ((PER_ROUND, ROUNDS, EPOCHS, 1000), (PER_ROUND, ROUNDS, EPOCHS, 500))),
    ("selected_cl_change", ((1, ROUNDS, EPOCHS, MIN_GOALS), (4, ROUNDS, EPOCHS, MIN_GOALS))),
)


@dataclass(frozen=True)
class Entry:
    """One run of FedAgent's matrix: its settings, and the preset and overrides that give them here."""

    name: str  # FedAgent's config path, without .yaml
    family: str
    env: str
    algorithm: str
    model: str = BACKBONES[0]
    total: int = TOTAL
    per_round: int = PER_ROUND
    rounds: int = ROUNDS
    epochs: int = EPOCHS
    min_goals: int = MIN_GOALS
    seed: int = SEED
    local_client_id: int = -1
    partition: str = "uniform"
    knobs: tuple[tuple[str, float], ...] = ()

    @property
    def preset(self) -> str:
        return f"paper_{self.env}_{self.algorithm}"

    @property
    def mode(self) -> str:
        return "local" if self.local_client_id >= 0 else ("centralized" if self.total == 1 else "federated")

    @property
    def search_return_n(self) -> int | None:
        return SEARCH_RETURN_N.get(self.family, DEFAULT_SEARCH_RETURN_N) if self.env == "webshop" else None

    def overrides(self, *, with_epochs: bool, data_dir: str = "", labels_dir: str = DEFAULT_LABELS_DIR) -> list[str]:
        """Hydra overrides of this run: the preset, then whatever differs from it."""
        items = [f"experiment={self.preset}"]
        if data_dir:
            items.append(f"env.data_dir={data_dir}")
        if self.mode != "federated":
            items.append(f"experiment.name={self.mode}")
        if self.local_client_id >= 0:
            items.append(f"experiment.local_client_id={self.local_client_id}")
        for key, value, default in (("model.path", self.model, BACKBONES[0]), ("seed", self.seed, SEED),
                                    ("clients.total", self.total, TOTAL),
                                    ("clients.per_round", self.per_round, PER_ROUND),
                                    ("num_rounds", self.rounds, ROUNDS)):
            if value != default:
                items.append(f"{key}={value}")
        if with_epochs and self.epochs != EPOCHS:  # paper_protocol sets E = EPOCHS
            items.append(f"{EPOCHS_KEY}={self.epochs}")
        if self.partition != "uniform":
            items.append(f"partition={self.partition}")
        if self.min_goals != MIN_GOALS:
            items.append(f"partition.min_goals_per_client={self.min_goals}")
        items += [f"partition.{key}={value}" for key, value in self.knobs]
        if self.partition == "hardness":
            items.append(f"partition.trajectories_file={labels_dir}/{LABELS_FILE.format(env=self.env)}")
        if self.search_return_n not in (None, DEFAULT_SEARCH_RETURN_N):
            items.append(f"env.search_return_n={self.search_return_n}")
        return items

    def settings(self, *, with_epochs: bool) -> dict[str, Any]:
        """The run's key settings, as the composed config has them (tests/test_experiments.py)."""
        n_envs, rollout_n = STEP_SHAPE[self.algorithm]
        return {
            "env": self.env, "algorithm": self.algorithm, "mode": self.mode, "model": self.model,
            "clients_total": self.total, "clients_per_round": min(self.per_round, self.total),
            "rounds": self.rounds, "epochs": self.epochs, "epochs_applied": with_epochs,
            "min_goals_per_client": self.min_goals, "seed": self.seed, "local_client_id": self.local_client_id,
            "partition": self.partition, "knobs": dict(self.knobs), "search_return_n": self.search_return_n,
            "envs_per_step": n_envs, "rollout_n": rollout_n,
        }

    def flwr_run(self, overrides: Sequence[str]) -> str:
        """The ``flwr run`` line: one SuperNode per client, each with its verl job's GPUs."""
        inner = " ".join(shlex.quote(item) if _needs_quoting(item) else item for item in overrides)
        run_config = 'overrides="' + inner + '"'  # Flower reads it as TOML: one basic string
        federation = f"num-supernodes={self.total} client-resources-num-gpus={GPUS_PER_CLIENT}"
        return (f"flwr run . --stream --run-config {shlex.quote(run_config)} "
                f"--federation-config {shlex.quote(federation)}")


def _needs_quoting(item: str) -> bool:
    """Whether an override must be quoted for parse_overrides' shlex split (``$`` and braces need not)."""
    return any(ch.isspace() or ch in "'\"\\#" for ch in item)


def _backbone_dir(model: str) -> str:
    return model.rsplit("/", 1)[-1]


def _file_name(env: str, algorithm: str, total: int, per_round: int, rounds: int, epochs: int, min_goals: int,
               suffix: str) -> str:
    """FedAgent's config file name (without .yaml)."""
    return (f"fed_{env}_{algorithm}_total-{total}_cl-per-rd-{per_round}_rd-{rounds}_ep-per-cl-{epochs}"
            f"_min-goals-per-cl-{min_goals}_p-{suffix}")


def paper_matrix() -> list[Entry]:
    """FedAgent's 176 paper runs, in its generator's order."""
    entries: list[Entry] = []
    for model in BACKBONES:
        for setting, changes in _UNIFORM_SETTINGS:
            for algorithm in ALGORITHMS:
                for env in ENVS:
                    total, per_round = changes.get("total", TOTAL), changes.get("per_round", PER_ROUND)
                    name = _file_name(env, algorithm, total, per_round, ROUNDS, EPOCHS, MIN_GOALS, "uniform")
                    entries.append(Entry(f"uniform/{_backbone_dir(model)}/{setting}/{algorithm}/{name}", "uniform",
                                         env, algorithm, model=model, total=total, per_round=per_round,
                                         seed=changes.get("seed", SEED),
                                         local_client_id=changes.get("local_client_id", -1)))
    for algorithm, directory, strategy, knobs, suffix in _ENV_HET:
        name = _file_name("webshop", algorithm, TOTAL, PER_ROUND, ROUNDS, EPOCHS, MIN_GOALS, suffix)
        folder = directory + ("_ppo" if algorithm == "ppo" else "")
        entries.append(Entry(f"env_heterogeneity/{folder}/{name}", "env_heterogeneity", "webshop", algorithm,
                             partition=strategy, knobs=tuple(knobs.items())))
    for algorithm in ALGORITHMS:
        for env in ENVS:
            for strategy, knobs, suffix in _TASK_HET:
                name = _file_name(env, algorithm, TOTAL, PER_ROUND, ROUNDS, EPOCHS, MIN_GOALS, suffix)
                entries.append(Entry(f"task_heterogeneity/{algorithm}/{env}/{name}", "task_heterogeneity", env,
                                     algorithm, partition=strategy, knobs=tuple(knobs.items())))
    for family, variants in _DECENTRALIZED:
        for env in ENVS:
            for algorithm in ALGORITHMS:
                for per_round, rounds, epochs, min_goals in variants:
                    name = _file_name(env, algorithm, TOTAL, per_round, rounds, epochs, min_goals, "uniform")
                    entries.append(Entry(f"decentralized/{family}/{algorithm}/{name}", "decentralized", env,
                                         algorithm, per_round=per_round, rounds=rounds, epochs=epochs,
                                         min_goals=min_goals))
    return entries


def config_has_epochs() -> bool:
    """Whether this build's config has E local epochs (``train.epochs``); composes the defaults."""
    from omegaconf import OmegaConf

    from fedagent_flwr.config import compose_config

    return OmegaConf.select(compose_config(), EPOCHS_KEY, default=None) is not None


def not_reproduced(with_epochs: bool) -> list[str]:
    """What of FedAgent's paper setting these runs do not reproduce yet (issue 15)."""
    notes = ["windowed rollout (one sample per turn, 2-step history): available as rollout.mode=windowed, but "
             "the presets keep the concat agent loop, with FedAgent's concat-mode token budgets: the windowed "
             "verl path has run 2 rounds of 2 clients on a GPU (docs/gpu.md §6), end to end, not yet learning"]
    if not with_epochs:
        notes.insert(1, f"E local epochs ({EPOCHS_KEY}): each round is train.local_steps = 1 step instead of E")
    return notes


def _parser() -> argparse.ArgumentParser:
    parser = one_line_parser("experiments", prog=program("python -m fedagent_flwr.experiments"), description=(
        "List FedAgent's paper experiment matrix with the flwr run line of each entry."))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--family", choices=FAMILIES, help="only this family")
    parser.add_argument("--env", choices=ENVS, help="only this environment")
    parser.add_argument("--algorithm", choices=ALGORITHMS, help="only this algorithm")
    parser.add_argument("--data-dir", default="", help="the environment's data (env.data_dir) in every line")
    parser.add_argument("--labels-dir", default=DEFAULT_LABELS_DIR,
                        help=f"directory of the hardness labels {LABELS_FILE.format(env='<env>')} "
                             f"(default {DEFAULT_LABELS_DIR})")
    return parser


def _check_path(option: str, value: str) -> str | None:
    """A problem with a path option, or None: the lines carry it inside a double-quoted string."""
    if any(ch in value for ch in "\"\\") or any(ord(ch) < 32 for ch in value):
        return f"{option} {value!r} holds a quote, backslash or control character; use a plainer path"
    return None


def render_text(rows: Sequence[dict[str, Any]], notes: Sequence[str]) -> str:
    """Each entry as its name, a line of key settings and its flwr run line."""
    lines = []
    for row in rows:
        s = row["settings"]
        knobs = "".join(f" {k}={v}" for k, v in s["knobs"].items())
        search = f" search_return_n={s['search_return_n']}" if s["search_return_n"] is not None else ""
        local = f" client={s['local_client_id']}" if s["local_client_id"] >= 0 else ""
        lines += [row["name"],
                  f"  {s['env']} {s['algorithm']} {s['mode']}{local} N={s['clients_total']} "
                  f"M={s['clients_per_round']} T={s['rounds']} E={s['epochs']} goals={s['min_goals_per_client']} "
                  f"seed={s['seed']} G={s['rollout_n']} envs/step={s['envs_per_step']} "
                  f"partition={s['partition']}{knobs}{search} model={s['model']}",
                  f"  {row['flwr_run']}"]
    counts = Counter(row["family"] for row in rows)
    lines.append(f"{len(rows)} runs: " + ", ".join(f"{f} {counts[f]}" for f in FAMILIES if counts[f]))
    lines += ["not reproduced yet:"] + [f"  - {note}" for note in notes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for option, value in (("--data-dir", args.data_dir), ("--labels-dir", args.labels_dir)):
        if problem := _check_path(option, value):
            print(f"experiments: error: {problem}", file=sys.stderr)
            return 2
    with_epochs = config_has_epochs()
    rows = []
    for entry in paper_matrix():
        if any(want and want != have for want, have in ((args.family, entry.family), (args.env, entry.env),
                                                         (args.algorithm, entry.algorithm))):
            continue
        overrides = entry.overrides(with_epochs=with_epochs, data_dir=args.data_dir, labels_dir=args.labels_dir)
        rows.append({"name": entry.name, "family": entry.family, "preset": entry.preset,
                     "settings": entry.settings(with_epochs=with_epochs), "overrides": overrides,
                     "flwr_run": entry.flwr_run(overrides)})
    notes = not_reproduced(with_epochs)
    print_output(json.dumps({"entries": rows, "not_reproduced": notes}, indent=1) if args.json
                 else render_text(rows, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
