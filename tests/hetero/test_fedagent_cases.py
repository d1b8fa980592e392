"""FedAgent's own partitions (shared/data/partitions/fedagent_public_cases.json) reproduced exactly.

Every case is checked twice: through the library (:func:`fedagent_flwr.hetero.partition_goals` and
the env-level functions) and through ``python -m fedagent_flwr.hetero.inspect`` (its ``main`` in
process for every case, a real subprocess for one case per kind). Client lists must match in
FedAgent's order: ALFWorld positions in the seed-42 game list as FedAgent returns them, WebShop
absolute goal indices sorted as FedAgent's wrappers return them.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from fedagent_flwr.hetero import GoalInfo, partition_goals
from fedagent_flwr.hetero.env_disjoint import per_client_count, selection_scores, spec_digest, spec_seeds
from fedagent_flwr.hetero.env_level import catalog_split, pool_variant, unshuffled_goal_asins
from fedagent_flwr.hetero.inspect import alfworld_goal_info, main
from testkit.flower_harness import REPO
from testkit.partition_sizes import coverage_sizes, hardness_sizes

SHARED = REPO.parent / "shared" / "data"
CASES_FILE = SHARED / "partitions" / "fedagent_public_cases.json"
LABELS = SHARED / "hardness" / "qwen2.5-1.5b_alfworld_trajectories.json"

pytestmark = pytest.mark.skipif(not CASES_FILE.is_file() or not LABELS.is_file(),
                                reason=f"FedAgent golden cases or labels not found under {SHARED}")

VARIANTS = ("bm25_reweight", "bm25_field_subset", "rank_wrapper", "lookalike")


@lru_cache(maxsize=1)
def golden() -> dict[str, Any]:
    return json.loads(CASES_FILE.read_text())


@lru_cache(maxsize=1)
def alfworld_info() -> list[GoalInfo]:
    return alfworld_goal_info(golden()["alfworld_ordered_paths"])


def family(case: dict[str, Any]) -> str:
    if case["strategy"] in VARIANTS:
        return "variants"
    if case["strategy"] == "catalog_split":
        return "catalog_split"
    return f"{case['env']}-{case['strategy']}"


def cases_of(name: str) -> list[Any]:
    if not CASES_FILE.is_file():
        return []
    return [pytest.param(c, id=c["id"]) for c in golden()["cases"] if family(c) == name]


def knobs_of(case: dict[str, Any]) -> tuple[dict[str, Any], int]:
    knobs = {k: v for k, v in case["knobs"].items() if k != "base_seed"}
    knobs["min_goals_per_client"] = case["min_goals"]
    if case["strategy"] == "hardness":
        knobs["trajectories_file"] = str(LABELS)
    return knobs, int(case["knobs"].get("base_seed", 42))


def through_library(case: dict[str, Any]) -> dict[str, list[int]]:
    knobs, seed = knobs_of(case)
    n_clients, strategy = case["N"], case["strategy"]
    if case["env"] == "alfworld":
        info = alfworld_info()
        return {str(c): partition_goals(strategy, c, n_clients, len(info), knobs, seed, info)
                for c in range(n_clients)}
    if case["env"] == "generic":
        return {str(c): partition_goals(strategy, c, n_clients, case["pool_size"], knobs, seed)
                for c in range(n_clients)}
    start = case["start_idx"]
    return {str(c): [start + g for g in partition_goals(strategy, c, n_clients, case["pool_size"], knobs, seed,
                                                          order="sorted")]
            for c in range(n_clients)}


def inspect_argv(case: dict[str, Any], paths_file: Path) -> list[str]:
    knobs, seed = knobs_of(case)
    argv = ["--strategy", case["strategy"], "--clients", str(case["N"]), "--seed", str(seed)]
    if case["min_goals"] is not None:
        argv += ["--min-goals", str(case["min_goals"])]
    for key, value in knobs.items():
        if key == "trajectories_file":
            argv += ["--labels", value]
        elif key != "min_goals_per_client":
            argv += ["--knob", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    if case["env"] == "alfworld":
        return ["--env", "alfworld", "--paths", str(paths_file), *argv]
    if case["env"] == "generic":
        return ["--env", "tinyguess", "--num-goals", str(case["pool_size"]), *argv]
    if case["strategy"] in VARIANTS:
        return ["--env", "webshop", *argv]
    return ["--env", "webshop", "--num-goals", str(case["start_idx"] + case["pool_size"]), *argv]


@pytest.fixture(scope="module")
def paths_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fedagent") / "alfworld_ordered_paths.json"
    path.write_text(json.dumps(golden()["alfworld_ordered_paths"]))
    return path


def through_command(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, list[int]]:
    capsys.readouterr()
    assert main(inspect_argv(case, paths_file)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["clients"]


def check(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = case["clients"]
    assert through_library(case) == want
    assert through_command(case, paths_file, capsys) == want


# --- one test per case family ---------------------------------------------------------------------


@pytest.mark.parametrize("case", cases_of("alfworld-uniform"))
def test_alfworld_uniform(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check(case, paths_file, capsys)


@pytest.mark.parametrize("case", cases_of("generic-uniform"))
def test_generic_uniform(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check(case, paths_file, capsys)


@pytest.mark.parametrize("case", cases_of("alfworld-preference"))
def test_alfworld_preference(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check(case, paths_file, capsys)
    inter = case["intermediate"]
    info = alfworld_info()
    order = list(dict.fromkeys(g.category for g in info))  # first appearance
    assert ["task_type_" + c for c in order] == inter["categories_in_order"]
    assert [sum(g.category == c for g in info) for c in order] == inter["category_sizes"]
    for cid, goals in case["clients"].items():
        mix = Counter(info[g].category for g in goals)
        assert [mix[c] for c in order] == inter["per_client"][cid]["counts"]
    # Without omega, FedAgent's partition_dataset uses tau (default 0.3).
    assert partition_goals("preference", 0, case["N"], len(info), {}, 42, info) == \
        partition_goals("preference", 0, case["N"], len(info), {"tau": 0.3}, 42, info) != case["clients"]["0"]


@pytest.mark.parametrize("case", cases_of("alfworld-coverage"))
def test_alfworld_coverage(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sizes = coverage_sizes(case["N"], 3553, case["min_goals"], case["knobs"]["size_std"])
    assert sizes == case["intermediate"]["client_sizes"]
    check(case, paths_file, capsys)


@pytest.mark.parametrize("case", cases_of("alfworld-hardness"))
def test_alfworld_hardness(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert hashlib.sha256(LABELS.read_bytes()).hexdigest() == case["labels"]["sha256"]
    quotas = hardness_sizes(case["N"], 3553, case["min_goals"], case["knobs"]["success_std"])
    assert quotas == case["intermediate"]["success_counts"]
    check(case, paths_file, capsys)


@pytest.mark.parametrize("case", cases_of("alfworld-env_disjoint"))
def test_alfworld_env_disjoint(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for spec, facts in case["intermediate"]["example_specs"].items():
        assert spec_digest(spec) == facts["sha256_hash31"]
        seeds = [spec_seeds(spec, c, 42) for c in range(case["N"])]
        assert {s for s, _ in seeds} == {facts["spec_seed"]} and [c for _, c in seeds] == facts["client_seeds"]
        if facts["n_scenes"] > 1:
            assert per_client_count(facts["n_games"], case["N"], case["knobs"]["env_div"]) == facts["n_per_client"]
    check(case, paths_file, capsys)
    # Without an explicit trial the env's GoalInfo (trial read from the task id) gives the same lists.
    info = [GoalInfo(category=g.category, task_id=g.task_id, scene=g.scene, group=g.group) for g in alfworld_info()]
    knobs, seed = knobs_of(case)
    assert partition_goals("env_disjoint", 1, case["N"], len(info), knobs, seed, info) == case["clients"]["1"]


@pytest.mark.parametrize("case", cases_of("webshop-coverage"))
def test_webshop_coverage(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert coverage_sizes(case["N"], case["pool_size"], 100, 16) == case["intermediate"]["client_sizes"]
    check(case, paths_file, capsys)


@pytest.mark.parametrize("case", cases_of("webshop-task_disjoint"))
def test_webshop_task_disjoint_goal_slices(case: dict[str, Any], paths_file: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    check(case, paths_file, capsys)
    # catalog_split slices its goals the same way
    catalog = {**case, "strategy": "catalog_split"}
    assert through_command(catalog, paths_file, capsys) == case["clients"]


def synthetic_products() -> list[dict[str, Any]]:
    """The case's catalogue rule, in the project's product form (options by lower-case name)."""
    out = []
    for j in range(1000):
        k = j % 4 + 1
        out.append({"asin": f"SYN{j:04d}", "instruction_text": "goal" if j % 5 else "",
                    "options": {"color": [f"c{i}" for i in range(k)]} if k > 1 else {}})
    return out


@pytest.mark.parametrize("case", cases_of("catalog_split"))
def test_catalog_split_catalogue(case: dict[str, Any]) -> None:
    products = synthetic_products()
    goal_asins = unshuffled_goal_asins(products)
    assert len(goal_asins) == case["n_goals"]
    start = case["start_idx"]
    for cid, want in case["clients"].items():
        variant = catalog_split(int(cid), case["N"], [p["asin"] for p in products], goal_asins[start:],
                                env_div=case["knobs"]["env_div"], keep_ratio=case["knobs"]["keep_ratio"],
                                min_goals_per_client=case["min_goals"], base_seed=case["knobs"]["base_seed"])
        assert [start + g for g in variant.goal_indices] == want
        assert sorted(variant.catalog) == case["catalog_asins"][cid]


@pytest.mark.parametrize("case", cases_of("variants"))
def test_variant_choice(case: dict[str, Any], paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n_variants, seed = case["knobs"]["variant_n"], case["knobs"]["base_seed"]
    for cid, want in case["clients"].items():
        variant = pool_variant(case["strategy"], int(cid), case["N"], n_variants, seed)
        assert [variant.index] == want and variant.name == case["variant_pool"][want[0]]
    assert through_command(case, paths_file, capsys) == case["clients"]


# --- inputs and the real command -----------------------------------------------------------------


def test_every_case_has_a_family_test() -> None:
    known = {"alfworld-uniform", "generic-uniform", "alfworld-preference", "alfworld-coverage", "alfworld-hardness",
             "alfworld-env_disjoint", "webshop-coverage", "webshop-task_disjoint", "catalog_split", "variants"}
    assert {family(c) for c in golden()["cases"]} == known


def test_alfworld_order_is_sorted_then_seed_42_shuffled() -> None:
    data = golden()
    ordered = data["alfworld_ordered_paths"]
    digest = hashlib.sha256("\n".join(ordered).encode()).hexdigest()
    assert len(ordered) == 3553 and digest == data["alfworld_ordered_paths_sha256"]
    reshuffled = sorted(ordered)
    assert hashlib.sha256("\n".join(reshuffled).encode()).hexdigest() == data["alfworld_game_list"]["sorted_sha256"]
    random.Random(42).shuffle(reshuffled)
    assert reshuffled == ordered


def test_spec_example_env_disjoint_positions() -> None:
    # specs/partitions.md §9: 8 games sorted 2,2,30,30,30,5,5,5; N = 3, env_div = 0.3 -> k = 4.
    import numpy as np

    spec = "pick_heat_then_place_in_recep-Apple-None-CounterTop"
    assert per_client_count(8, 3, 0.3) == 4
    assert list(np.argsort(selection_scores(spec, 8, 0, 0.3))[:4]) == [6, 5, 0, 7]
    assert list(np.argsort(selection_scores(spec, 8, 1, 0.3))[:4]) == [5, 0, 6, 3]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedagent_flwr.hetero.inspect", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


@pytest.mark.parametrize("case_id", ["alfworld-coverage-size_std16-N3-L100", "alfworld-hardness-success_std16-N3-L100",
                                     "webshop-coverage-size_std16-N3-L100", "webshop-rank_wrapper-variant_n3-N5"])
def test_the_real_command(case_id: str, paths_file: Path) -> None:
    (case,) = [c for c in golden()["cases"] if c["id"] == case_id]
    proc = _run(*inspect_argv(case, paths_file))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"clients": case["clients"]}


def test_command_takes_fedagent_knob_names(paths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A case's knobs passed as they are (base_seed, min_goals_per_client included) give the case."""
    (case,) = [c for c in golden()["cases"] if c["id"] == "alfworld-env_disjoint-env_div0.3-fallback_skip-N3"]
    argv = ["--env", "alfworld", "--paths", str(paths_file), "--strategy", "env_disjoint", "--clients", "3",
            "--knob", "min_goals_per_client=100"] + [
                a for k, v in case["knobs"].items() for a in ("--knob", f"{k}={v}")]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["clients"] == case["clients"]
    assert main([*argv, "--seed", "43"]) == 2
    assert capsys.readouterr().err == "inspect: error: --knob base_seed: 42 contradicts --seed 43; give one of them\n"


def test_command_summary_and_errors(paths_file: Path) -> None:
    proc = _run("--env", "alfworld", "--strategy", "hardness", "--clients", "3", "--knob", "success_std=16",
                "--paths", str(paths_file), "--labels", str(LABELS), "--summary")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("client 0: 100 goals, easy 58; ") and "pick_and_place_simple" in lines[1]
    assert lines[-1] == "union: 295 of 3553 goals; 3258 in no client"
    for argv, message in [
        (["--env", "alfworld", "--strategy", "preference", "--num-goals", "3553"],
         "inspect: error: --num-goals: strategy 'preference' reads goal metadata; give --paths FILE or --data-dir DIR"),
        (["--env", "alfworld", "--strategy", "hardness", "--paths", str(paths_file)], "inspect: error: --labels: "),
        (["--env", "alfworld", "--strategy", "randomish", "--num-goals", "9"], "inspect: error: --strategy: "),
        (["--env", "webshop", "--num-goals", "400"], "inspect: error: --num-goals: must be at least 501"),
        (["--env", "alfworld", "--strategy", "coverage", "--num-goals", "3553", "--min-goals", "600"],
         "inspect: error: --min-goals: coverage needs min_goals_per_client <= 500"),
        (["--env", "alfworld", "--strategy", "env_disjoint", "--knob", "fallback=rooms", "--paths", str(paths_file)],
         "inspect: error: --knob fallback: "),
        (["--env", "tinyguess", "--knob", "omega"], "inspect: error: --knob: expected KEY=VALUE"),
        # what a run's config refuses: a misspelt knob (it would print the default's partition), and a
        # known knob of the wrong type even where the strategy does not read it
        (["--env", "alfworld", "--strategy", "coverage", "--num-goals", "3553", "--knob", "sizestd=16"],
         "inspect: error: --knob sizestd: is not a knob of the built-in partition strategies: "
         "did you mean 'size_std'?"),
        (["--env", "tinyguess", "--knob", "size_std=abc"],
         "inspect: error: --knob size_std: config key 'partition.size_std' must be float, got 'abc'"),
        (["--env", "tinyguess", "--strategy", "catalog_split"], "inspect: error: --strategy: "),
        (["--env", "alfworld"], "inspect: error: --data-dir: "),
        (["--env", "alfworld", "--clients", "three"], "inspect: error: argument --clients: invalid int value"),
    ]:
        proc = _run(*argv)
        assert proc.returncode == 2 and proc.stdout == "", argv
        assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


def test_command_default_tinyguess_run() -> None:
    # FedAgent's floor (100) above TinyGuess's 10 secrets gives every client the whole pool; the
    # default run's floor of 1 splits them.
    assert json.loads(_run("--env", "tinyguess").stdout) == {"clients": {"0": list(range(10)), "1": list(range(10))}}
    assert json.loads(_run("--env", "tinyguess", "--min-goals", "1").stdout) == {
        "clients": {"0": [0, 1, 2, 3, 4], "1": [5, 6, 7, 8, 9]}}
