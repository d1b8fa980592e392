"""The ``trainer`` group's schema: the ClientApp's keys, then one schema per backend.

Each knob is declared once, here, with its default and bound; ``conf/trainer/<backend>.yaml``
extends the backend's schema (Hydra's structured config as schema), the server checks the
composed group with :func:`~fedagent_flwr.schema.fields.check`, and the trainers build their
settings from the same classes (``GRPOConfig``, ``VerlSettings`` add behaviour, no fields).
A verl preset such as ``verl_ppo`` is a YAML file over the verl schema, not a schema of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fedagent_flwr.schema.fields import SettingError, check, renamed, setting
from fedagent_flwr.schema.lora import LoraKnobs

TRAINER_MODES = ("subprocess", "persistent")
ROLLOUT_MODES = ("concat", "windowed")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
PREFILL_MODES = ("incremental", "full")  # EvalKnobs.prefill
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZER_STATES = ("reset", "keep")  # OptimizerStateKeys.optimizer_state
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# keyword names that Hydra's override grammar reads back as other values (any letter case)
_NOT_STRING_KEYS = frozenset({"true", "false", "null", "nan", "inf"})
_MODULE = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
# The backends verl 0.9.1's Tracking accepts (``Tracking.supported_backend`` in
# verl/utils/tracking.py); a test checks this list against the installed verl.
VERL_LOGGERS = ("wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio",
                "file", "rl_insight")
# verl keys the backend writes from a setting or a round's plan and then relies on outside verl (validation
# plays under the same token bounds, request seeds and the zero-variance share count GRPO groups of
# rollout_n, the client reads the model, the checkpoint and the file log the job writes): a second value
# in extra_overrides would make verl run one way while the project acts on the other.
# Key -> (what sets it, the setting to change instead or "" where none is the user's).
DERIVED_VERL_KEYS: dict[str, tuple[str, str]] = {
    "data.max_prompt_length": ("trainer.max_prompt_length", "trainer.max_prompt_length"),
    "actor_rollout_ref.rollout.prompt_length": ("trainer.max_prompt_length", "trainer.max_prompt_length"),
    "data.max_response_length": ("trainer.max_response_length", "trainer.max_response_length"),
    "actor_rollout_ref.rollout.response_length": ("trainer.max_response_length", "trainer.max_response_length"),
    "actor_rollout_ref.rollout.n": ("trainer.rollout_n", "trainer.rollout_n"),
    "actor_rollout_ref.rollout.agent.num_workers": ("trainer.agent_workers", "trainer.agent_workers"),
    "trainer.use_v1": ("trainer.use_v1", "trainer.use_v1"),
    "trainer.logger": ("trainer.verl_logger (console and file always on: the client reads the file)",
                       "trainer.verl_logger"),
    "data.train_batch_size": ("env.train's n_envs (one row per env instance a step)", "env.train's n_envs"),
    "trainer.total_training_steps": ("train.local_steps and train.epochs", "train.local_steps or train.epochs"),
    "trainer.total_epochs": ("train.epochs", "train.epochs"),
    "trainer.save_freq": ("train.local_steps and train.epochs (the last step is saved)", ""),
    "trainer.default_local_dir": ("the client's output folder", ""),
    "trainer.resume_mode": ("the round (every job starts from the global model)", ""),
    "actor_rollout_ref.model.path": ("the round's global model", ""),
    "actor_rollout_ref.actor.checkpoint.save_contents": ("what the client reads back (model and extra)", ""),
    "data.train_files": ("the round's row plan", ""),
    "data.val_files": ("the round's row plan", ""),
    "data.custom_cls.path": ("the project's dataset of env rows", ""),
    "data.custom_cls.name": ("the project's dataset of env rows", ""),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": ("the project's agent loop", ""),
    "actor_rollout_ref.rollout.agent.default_agent_loop": ("the project's agent loop", ""),
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class": ("rollout.mode and trainer.request_seeds",
                                                                 "rollout.mode or trainer.request_seeds"),
    # the agent loop, verl's own rendering and the evaluator's validation must render prompts alike
    "data.apply_chat_template_kwargs": ("model.chat_template_kwargs (validation renders with it too)",
                                        "model.chat_template_kwargs"),
}


@dataclass
class ClientAppKeys:
    """What the ClientApp reads itself to run a backend; the rest of the group is the backend's."""

    module: ClassVar[str]  # what the ClientApp runs (python -m MODULE train|evaluate JOB.json)

    backend: str = setting("reference")  # a key of TRAINER_SCHEMAS
    timeout_s: float = setting(3600.0, gt=0)  # a trainer job running longer is killed and the client fails
    # subprocess: a fresh trainer per client-round; persistent: one per node, kept across rounds
    mode: str = setting("subprocess", choices=TRAINER_MODES)
    persistent_idle_s: float = setting(3600.0, gt=0)  # a persistent trainer idle this long exits (frees its GPU)
    # a job whose output shows no progress this long is stopped (docs/gpu.md "Stalls")
    stall_timeout_s: float = setting(900.0, ge=0, note="0 disables the progress watchdog")


@dataclass
class ClientRuleKeys:
    """A user's client rule (docs/extending.md), run by either backend before every optimiser step."""

    client_rule: str = setting("")  # dotted path of a rule class run before every optimiser step ("" -> none)
    client_rule_args: Any = None  # its keyword arguments, e.g. {mu: 0.1, freeze: embed_tokens}


#: a backend's whole trainer group, typed (ReferenceTrainer or VerlTrainer)
TrainerSettings = ClientAppKeys
#: the keys the ClientApp consumes itself (not sent to the backend)
CLIENTAPP_TRAINER_KEYS = tuple(f.name for f in dataclasses.fields(ClientAppKeys))
#: the client-rule keys, which a backend hands to the rule rather than to its own settings
RULE_KEYS = tuple(f.name for f in dataclasses.fields(ClientRuleKeys))


@dataclass
class OptimizerStateKeys:
    """What a client's optimiser carries from one of its rounds to the next (a trainer backend's key)."""

    # reset: every client-round starts a fresh AdamW and LR schedule (FedAgent's reload_client_model), so
    # its first steps are bias-corrected sign-like steps; keep: a persistent trainer replaces the weights
    # with the round's global model but keeps the client's AdamW moments, step counts and LR schedule from
    # its previous round (needs trainer.mode=persistent; docs/gpu.md "Optimiser state across rounds")
    optimizer_state: str = setting("reset", choices=OPTIMIZER_STATES)

    def check_optimizer_state(self, prefix: str, backend: str) -> None:
        """Refuse ``keep`` where nothing outlives a client-round: the subprocess mode starts every
        client-round in a new process. ``mode`` is known on the server, which checks the whole group
        before round 0; a job's own settings do not carry it, and a fresh trainer process given a
        ``keep`` job (a persistent trainer's job, rerun after that trainer died) trains from a new
        optimiser and reports ``optimizer_state_kept`` 0.0."""
        if self.optimizer_state == "keep" and getattr(self, "mode", None) == "subprocess":
            raise SettingError(
                f"config key '{prefix}.optimizer_state' = 'keep' needs {prefix}.mode=persistent: with "
                f"{prefix}.mode=subprocess every client-round runs in a new {backend} process, so no optimiser "
                f"state is left to keep; set {prefix}.mode=persistent or {prefix}.optimizer_state=reset")


@dataclass
class Rollout:
    """The agent loop, for training and evaluation alike (the config's ``rollout`` group): concat (one
    growing conversation) or windowed (one prompt per turn showing the last ``history_length`` steps)."""

    # concat: one sample per episode, the conversation grows | windowed: FedAgent's paper setting, one
    # sample per turn whose prompt shows the last history_length steps (docs/agent-loop.md)
    mode: str = setting("concat", choices=ROLLOUT_MODES)
    history_length: int = setting(2, ge=0, note="the (observation, action) pairs a windowed prompt shows")


#: the trainer keys that carry run settings outside ``trainer`` to the jobs -> the run key that sets them
#: (set there, not in ``trainer``): the ``rollout`` group, the model's chat-template arguments and its LoRA
AGENT_LOOP_KEYS = {"rollout_mode": "rollout.mode", "history_length": "rollout.history_length",
                   "chat_template_kwargs": "model.chat_template_kwargs", "lora": "model.lora"}
CHAT_TEMPLATE_KEY = "model.chat_template_kwargs"
CHAT_TEMPLATE_USAGE = (f"set {CHAT_TEMPLATE_KEY} to a mapping of the template's keyword names to true/false, numbers, "
                       f"strings, null or lists of them, e.g. {CHAT_TEMPLATE_KEY}={{enable_thinking:false}}")
# apply_chat_template's own arguments that the renderers set (or that change what it returns): a
# template keyword of the same name would clash with them or break the rendering
_RENDERER_ARGS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                  "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs")


def _json_leaf(value: Any) -> bool:
    """A value a chat template keyword may take: a JSON scalar (finite number) or a list of them."""
    if isinstance(value, list):
        return all(_json_leaf(item) for item in value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return "${" not in value  # Hydra and OmegaConf would read an interpolation in verl's config
    return value is None or isinstance(value, (bool, int))


def chat_template_kwargs_from_json(text: str) -> dict[str, Any]:
    """A command line's ``--chat-template-kwargs`` JSON object, checked as ``model.chat_template_kwargs``
    is (ValueError, SettingError among them, saying what is wrong)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    check_chat_template_kwargs(value)
    return value


def check_chat_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """SettingError, naming ``model.chat_template_kwargs``, unless ``kwargs`` maps keyword names
    (identifiers: the template reads them as variables, verl gets them as a Hydra mapping) to JSON
    scalars or lists of them, none of them an argument the renderers give ``apply_chat_template``
    themselves."""
    usage = CHAT_TEMPLATE_USAGE
    for key, value in kwargs.items():
        if not isinstance(key, str) or not _IDENTIFIER.fullmatch(key):
            raise SettingError(f"config key '{CHAT_TEMPLATE_KEY}' has the key {key!r}, not a keyword name "
                               f"(letters, digits and '_', not starting with a digit): {usage}")
        if key.lower() in _NOT_STRING_KEYS:
            # Hydra reads these bare words back as a boolean, None or a float, not as a name
            raise SettingError(f"config key '{CHAT_TEMPLATE_KEY}' has the key {key!r}, which verl's config would "
                               f"read as {key.lower()}, not as a keyword name: {usage}")
        if key in _RENDERER_ARGS:
            raise SettingError(f"config key '{CHAT_TEMPLATE_KEY}.{key}' is an argument of apply_chat_template "
                               "that the agent loop sets itself; leave it out")
        if not _json_leaf(value):
            raise SettingError(f"config key '{CHAT_TEMPLATE_KEY}.{key}' = {value!r} is not a JSON scalar or list "
                               f"of them (a string without '${{'): {usage}")


@dataclass
class ChatTemplateKnobs:
    """How prompts are rendered: keyword arguments of the tokenizer's chat template, declared once for
    the run's ``model`` group and the jobs (the reference trainer, the evaluator, verl's
    ``data.apply_chat_template_kwargs`` and the agent loop all render with them)."""

    # e.g. {enable_thinking: false} for Qwen3's template; {} renders with the template's own defaults
    chat_template_kwargs: dict[str, Any] = setting(factory=dict)

    def __post_init__(self) -> None:
        check_chat_template_kwargs(self.chat_template_kwargs)


@dataclass
class AgentLoopKnobs(ChatTemplateKnobs, LoraKnobs):
    """What the jobs take from outside ``trainer``: the agent loop (:class:`Rollout`'s fields, default
    and bound, renamed), the model's chat-template arguments and its LoRA settings (``model.lora``)."""

    rollout_mode: str = renamed(Rollout, "mode")
    history_length: int = renamed(Rollout, "history_length")


@dataclass
class EvalKnobs:
    """How validation episodes are sampled (the Hugging Face evaluator both backends use)."""

    max_new_tokens: int = setting(32, ge=1)  # tokens one turn may sample
    val_temperature: float = setting(0.4, gt=0)  # FedAgent's validation temperature
    val_top_p: float = setting(1.0, gt=0, le=1)
    max_model_len: int = setting(1024, ge=16)  # token budget of one episode
    gen_batch_size: int = setting(32, ge=1)  # episodes sampled together (1: one after the other)
    # incremental: keep each episode's keys and values between its turns, prefill only new tokens
    # (a GRPO group's shared first prompt once); full: prefill every prompt in full (the earlier
    # sampler; sampled tokens can differ by float rounding only, docs/performance.md).
    prefill: str = setting("incremental", choices=PREFILL_MODES)
    num_threads: int = setting(0, ge=0, note="0 keeps torch's default")
    compute_dtype: str = setting("auto", choices=COMPUTE_DTYPES)
    device: str = setting("auto", choices=DEVICES)  # where evaluation runs


@dataclass
class ReferenceKnobs(EvalKnobs, OptimizerStateKeys):
    """The CPU reference trainer's GRPO hyper-parameters (defaults follow FedAgent/verl)."""

    rollout_n: int = setting(2, ge=1)  # GRPO group size G (episodes per env seed)
    lr: float = setting(1e-5, gt=0)
    weight_decay: float = setting(0.0, ge=0)
    kl_coef: float = setting(0.0, ge=0)  # low-variance KL (k3) to the starting weights; FedAgent's paper: 0.01
    entropy_coeff: float = setting(0.001, ge=0)  # FedAgent's; keeps updates non-zero at zero advantage
    clip_ratio: float = setting(0.2, gt=0)
    ppo_epochs: int = setting(1, ge=1)
    grad_clip: float = setting(1.0, note="verl's actor default; <= 0 disables clipping")
    temperature: float = setting(1.0, gt=0)
    top_p: float = setting(1.0, gt=0, le=1)
    micro_batch_size: int = setting(8, ge=1)  # episodes per forward/backward in the update

    def check_together(self, prefix: str) -> None:
        """Settings that constrain each other."""
        self.check_optimizer_state(prefix, "reference")
        lora = getattr(self, "lora", None)  # a job's settings carry model.lora
        if lora is not None and lora.rank > 0 and self.optimizer_state == "keep":
            raise SettingError(
                f"config key '{prefix}.optimizer_state' = 'keep' does not go with model.lora.rank = {lora.rank}: every "
                "round trains a fresh adapter, whose parameters have no moments from an earlier round; set "
                f"{prefix}.optimizer_state=reset")


@dataclass
class VerlKnobs(OptimizerStateKeys):
    """Hyper-parameters and resources of one client's verl job."""

    rollout_n: int = setting(4, ge=1)  # GRPO group size G (rollout.n)
    lr: float = setting(1e-6, gt=0)  # actor learning rate
    critic_lr: float = setting(1e-5, gt=0)  # PPO critic learning rate
    kl_coef: float = setting(0.01, ge=0)  # KL loss (low_var_kl) to the reference model; 0 turns it off
    entropy_coeff: float = setting(0.001, ge=0)
    clip_ratio: float = setting(0.2, gt=0)
    ppo_epochs: int = setting(1, ge=1)
    ppo_mini_batch_size: int = setting(8, ge=1)  # prompts per mini-batch (clamped to the step's batch)
    micro_batch_size_per_gpu: int = setting(4, ge=1)
    max_prompt_length: int = setting(512, ge=1)  # first-turn prompt budget (system prompt + reset observation)
    max_response_length: int = setting(512, ge=1)  # all turns' tokens after the prompt (model + observations)
    max_new_tokens: int = setting(64, ge=1)  # tokens one turn may sample
    temperature: float = setting(1.0, gt=0)
    top_p: float = setting(1.0, gt=0, le=1)
    val_temperature: float = setting(0.4, gt=0)  # evaluation episodes (HF generation on the node's GPU)
    # FedAgent's penalty per invalid action (envs that report is_action_valid)
    invalid_action_penalty: float = setting(0.1, ge=0)
    n_gpus_per_node: int = setting(1, ge=1)  # GPUs one client's verl job uses
    gpu_memory_utilization: float = setting(0.3, gt=0, le=1)  # vLLM's share of each GPU (two clients can share one)
    # fixed vLLM KV cache per GPU; 0 lets vLLM profile (unsafe when clients share a GPU)
    kv_cache_gib: float = setting(4.0, ge=0, note="0 lets vLLM profile")
    enforce_eager: bool = setting(True)  # skip CUDA-graph capture: faster start for short client jobs
    # vLLM's CUDA-graph batch sizes when enforce_eager is false (empty: vLLM's own list); fewer
    # sizes, shorter capture at start-up (docs/gpu.md, "Start-up phases").
    cudagraph_capture_sizes: list[int] = setting(factory=list, ge=1)
    # torch.compile of the actor's (and reference's) entropy-from-logits, verl's default; false
    # skips its first-step compile at the price of an eager kernel.
    torch_compile: bool = setting(True)
    agent_workers: int = setting(2, ge=1)  # Ray agent-loop workers (rollout.agent.num_workers)
    # true: every vLLM request gets a seed derived from its rollout (env seed, step, row, place in the
    # GRPO group) and turn, distinct within a group, the same in two runs (trainers/verl/request_seeds.py);
    # needs agent_workers to divide the env instances of a step. false: vLLM samples unseeded, as before.
    request_seeds: bool = setting(False)
    # true: the job's vLLM runs in vLLM's batch-invariant mode (beta; VLLM_BATCH_INVARIANT=1 in the job's
    # environment, trainers/verl/job.py), so a request's logits do not depend on what it is batched with
    # and, with request_seeds, two runs can sample the same rollouts; slower kernels. Sampling only: FSDP
    # training stays as it was. false: vLLM's own kernels (an inherited VLLM_BATCH_INVARIANT is dropped).
    batch_invariant: bool = setting(False)
    # true (a diagnostic): every vLLM request of the agent loop appends one line to
    # <output>/verl/request_fingerprints.jsonl: its vLLM seed, env seed, row and turn, and SHA-256 digests
    # of its prompt, returned tokens and their log-probs, so two runs' first differing request can be
    # found (trainers/verl/agent_loop.py). false: nothing is written.
    request_fingerprints: bool = setting(False)
    ray_num_cpus: int = setting(8, ge=1)  # logical CPUs of the job's private Ray cluster
    use_v1: bool = setting(False)  # verl's legacy trainer reaches the first step ~35 s sooner than V1
    # sdpa: no flash-attn wheel for torch 2.11/CUDA 13
    attn_implementation: str = setting("sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    use_remove_padding: bool = setting(False)  # padding-free packing needs varlen flash-attn
    # raw Hydra overrides for verl, appended last (e.g. ["actor_rollout_ref.actor.optim.weight_decay=0"])
    extra_overrides: list[str] = setting(factory=list, pattern=r"[^=\n\r\0][^\n\r\0]*=[^\n\r\0]*",
                                         note="a Hydra override of the form key=value")
    # modules imported in every verl process right after core_algos (estimators, policy losses)
    plugin_modules: list[str] = setting(factory=list, pattern=_MODULE, note="a module name such as mypkg.estimators")
    # verl's own loggers besides console and file, which are always on (the client reads the file)
    verl_logger: list[str] = setting(factory=list)

    def check_together(self, prefix: str) -> None:
        """Settings that constrain each other."""
        self.check_optimizer_state(prefix, "verl")
        lora = getattr(self, "lora", None)  # a job's settings carry model.lora
        if lora is not None and lora.rank > 0:
            raise SettingError(f"config key 'model.lora.rank' = {lora.rank}: model.lora is supported by the reference "
                               "trainer; verl LoRA is not wired yet (set model.lora.rank=0, or trainer=reference)")
        if self.max_new_tokens > self.max_response_length:
            raise SettingError(
                f"config key '{prefix}.max_new_tokens' ({self.max_new_tokens}) exceeds {prefix}.max_response_length "
                f"({self.max_response_length}): not even one turn would fit"
            )
        if getattr(self, "rollout_mode", None) == "windowed" and self.use_v1:  # a job's settings carry the loop
            raise SettingError(
                f"config key '{prefix}.use_v1' = true does not support rollout.mode=windowed (its per-turn rows are "
                "built for verl's classic PPO trainer): set trainer.use_v1=false or rollout.mode=concat")
        if self.request_seeds and self.use_v1:
            raise SettingError(
                f"config key '{prefix}.use_v1' = true does not support {prefix}.request_seeds=true (its seeded "
                "workers are built for verl's classic PPO trainer): set trainer.use_v1=false or request_seeds=false")
        for name in self.verl_logger:
            if name not in VERL_LOGGERS:
                raise SettingError(f"{prefix}.verl_logger entry {name!r} is not one of verl's loggers; choose from "
                                   f"{list(VERL_LOGGERS)} (console and file are always on)")
        for item in self.extra_overrides:
            key = item.split("=", 1)[0].strip().lstrip("+~")
            # the key itself, a node above it (data={...} replaces data.max_prompt_length too) or below it
            # (data.apply_chat_template_kwargs.enable_thinking=false changes the derived mapping)
            derived = key if key in DERIVED_VERL_KEYS else next(
                (k for k in DERIVED_VERL_KEYS if k.startswith(key + ".") or key.startswith(k + ".")), None)
            if derived is not None:
                source, instead = DERIVED_VERL_KEYS[derived]
                raise SettingError(
                    f"config key '{prefix}.extra_overrides' entry {item!r} sets verl's {derived}, which the verl "
                    f"backend sets from {source} and relies on outside verl too: drop the entry"
                    + (f" and set {instead} instead" if instead else ""))
        if self.cudagraph_capture_sizes and self.enforce_eager:
            raise SettingError(
                f"{prefix}.cudagraph_capture_sizes needs {prefix}.enforce_eager=false (eager vLLM "
                "captures no CUDA graphs): set enforce_eager to false or leave cudagraph_capture_sizes empty")


@dataclass
class PerClientKeys:
    """Resources of single clients (nodes of different sizes), read by the server only
    (:mod:`fedagent_flwr.per_client`): each client's job carries its own values, not this key."""

    # client id -> {resource key: value}, e.g. {0: {n_gpus_per_node: 2}} (docs/gpu.md); None: no client differs
    # (not an empty mapping: Hydra would refuse new keys in it, and a run sets the mapping whole)
    per_client: Any = setting(None)


@dataclass
class ReferenceJob(ReferenceKnobs, ClientRuleKeys, ClientAppKeys):
    """The reference backend's keys that every job of it carries."""

    module: ClassVar[str] = "fedagent_flwr.trainers.reference"


@dataclass
class VerlJob(VerlKnobs, ClientRuleKeys, ClientAppKeys):
    """The verl backend's keys that every job of it carries."""

    module: ClassVar[str] = "fedagent_flwr.trainers.verl.entry"


@dataclass
class ReferenceGroup(PerClientKeys, ReferenceJob):
    """``conf/trainer/reference.yaml``'s schema."""


@dataclass
class VerlGroup(PerClientKeys, VerlJob):
    """``conf/trainer/verl.yaml``'s schema (and its presets')."""


@dataclass
class ReferenceTrainer(AgentLoopKnobs, ReferenceJob):
    """What a reference job runs with: its keys and the run's agent loop."""


@dataclass
class VerlTrainer(AgentLoopKnobs, VerlJob):
    """What a verl job runs with: its keys and the run's agent loop."""


#: trainer.backend -> the schema of its config group (Hydra's; ``module``: what the ClientApp runs)
TRAINER_GROUPS: dict[str, type[ClientAppKeys]] = {"reference": ReferenceGroup, "verl": VerlGroup}
#: trainer.backend -> the typed settings its jobs carry (the group plus the agent loop). The one registry.
TRAINER_SCHEMAS: dict[str, type[ClientAppKeys]] = {"reference": ReferenceTrainer, "verl": VerlTrainer}


def trainer_settings(raw: Mapping[str, Any] | ClientAppKeys, prefix: str = "trainer") -> ClientAppKeys:
    """The ``trainer`` group as its backend's typed settings, checked by the one validator (a
    typed one is returned as it is: it was checked when it was built)."""
    if isinstance(raw, ClientAppKeys):
        return raw
    if not isinstance(raw, Mapping):
        raise SettingError(f"config key '{prefix}' must be a mapping, got {raw!r}")
    backend = raw.get("backend", ClientAppKeys.backend)
    if backend not in TRAINER_SCHEMAS:
        raise SettingError(
            f"config key '{prefix}.backend' = {backend!r}: available backends are {tuple(TRAINER_SCHEMAS)}")
    return check(TRAINER_SCHEMAS[backend], raw, prefix)[0]
