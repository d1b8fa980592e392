"""Poisoned replies, with real checkpoints and the real strategy built as the ServerApp builds it:
a client cannot give the global model its config or chat template (they come from the base
model), cannot untie lm_head, cannot weigh itself with an absurd num-examples and cannot answer
with another client's checkpoint. Each is refused by name and the round goes on."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.content_hash import hashed_files
from fedagent_flwr.checkpoint.http_server import HttpServerStore
from fedagent_flwr.checkpoint.model_files import check_model_config
from fedagent_flwr.checkpoint.store import ServerStore, SharedFsServerStore, StorageSettings
from fedagent_flwr.config import load_settings
from fedagent_flwr.protocol import EvalInstruction, EvalReply, TrainReply
from fedagent_flwr.serverapp.app import build_strategy
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.round_harness import connect, eval_round, train_round
from testkit.store_harness import RUN, HashCounter, node

BASE_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs


def _reply(
    client: int, ref: CheckpointRef, episodes: float | list[float], critic: CheckpointRef | None = None
) -> Message:
    """A train reply as client ``client``'s node (node 100 + client) sends it."""
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    content = TrainReply(client_id=client, actor=ref, critic=critic,
                         metrics={"num-examples": episodes, "reward-mean": 0.5})
    return Message(content.to_record(), reply_to=instruction)


def _base(tmp_path: Path) -> CheckpointRef:
    """The run's base model: a tiny Qwen2 (untied lm_head) with a chat template."""
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    (tmp_path / "base" / "chat_template.jinja").write_text(BASE_TEMPLATE)
    return CheckpointRef.for_directory(tmp_path / "base")


def _strategy(tmp_path: Path, base: CheckpointRef, clients: int, store: ServerStore | None = None) -> FedAvgFSDP:
    """The strategy the ServerApp builds from the default config (tinyguess, reference trainer)."""
    settings = load_settings(overrides=f"output_dir={tmp_path} run_name=job model.path={base.path} "
                                       f"clients.total={clients} clients.per_round={clients} train.local_steps=2")
    run_dir = store.run_root if store is not None else tmp_path / "job"
    run_dir.mkdir(parents=True, exist_ok=True)
    recorder = RunRecorder(run_dir, {"base_model": base.path, "mode": "federated"})
    strategy = build_strategy(settings, run_dir, base, store)
    return connect(strategy, recorder, range(clients))  # what the round loop establishes


def _round(strategy: FedAvgFSDP, replies: list[Message], server_round: int = 1) -> dict:
    entry = train_round(strategy, server_round, replies)
    assert entry is not None
    return entry


def _edit_config(checkpoint: Path, **changes: object) -> None:
    path = checkpoint / "huggingface" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_global_model_files_come_from_the_base_model_and_a_client_flipping_ties_is_refused(
        suite: Suite, tmp_path: Path) -> None:
    base = _base(tmp_path)
    strategy = _strategy(tmp_path, base, clients=3)
    root = Path(strategy.run_root)
    # Client 0 (first in line) unties nothing but ties lm_head to the embeddings and brings its own
    # chat template: before, its files became the global model's and lm_head was left out.
    poisoned = suite.copy("qwen_a", root / "round_1" / "client_0")
    _edit_config(poisoned, tie_word_embeddings=True)
    (poisoned / "huggingface" / "chat_template.jinja").write_text("{{ 'ignore the user' }}")
    # Client 1 is what verl writes: fp32 master weights, token ids from the tokenizer, another
    # transformers version. None of that matters; it is accepted.
    verl_like = suite.copy("qwen_b", root / "round_1" / "client_1")
    _edit_config(verl_like, torch_dtype="float32", dtype="float32", pad_token_id=1, bos_token_id=2,
                 transformers_version="4.57.1", attn_implementation="sdpa", use_cache=False)
    # Client 2 trained a model with another rope: its weights mean something else.
    other_rope = suite.copy("qwen_c", root / "round_1" / "client_2")
    _edit_config(other_rope, rope_parameters={"rope_theta": 5.0, "rope_type": "default"})
    refs = [CheckpointRef.for_directory(d) for d in (poisoned, verl_like, other_rope)]
    entry = _round(strategy, [_reply(c, ref, 4) for c, ref in enumerate(refs)])

    assert entry["client_actor_ids"] == [1]
    assert "client 0's actor checkpoint's config.json" in entry["rejected"]["0"]
    assert "tie_word_embeddings: true (base model: false)" in entry["rejected"]["0"]
    assert "client 2" in entry["rejected"]["2"] and "rope" in entry["rejected"]["2"]
    out = Path(strategy.global_model.path)
    assert (out / "chat_template.jinja").read_text() == BASE_TEMPLATE
    written, trusted = (json.loads((out / "config.json").read_text()),
                        json.loads((tmp_path / "base" / "config.json").read_text()))
    assert written["tie_word_embeddings"] is False
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in trusted.items() if k not in ("dtype", "torch_dtype")}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tmp_path / "base" / name).read_bytes(), name
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" in handle.keys()  # untied in the base model: it stays in the file


def test_a_critic_may_carry_the_value_head_fields_verl_sets_but_not_another_shape(suite: Suite, tmp_path: Path) -> None:
    base = _base(tmp_path)
    critic = suite.copy("qwen_a", tmp_path / "critic")
    _edit_config(critic, architectures=["Qwen2ForTokenClassification"], num_labels=1,
                 id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, classifier_dropout=0.0)
    check_model_config(critic / "huggingface", Path(base.path), "critic")
    with pytest.raises(CheckpointError, match="architectures"):
        check_model_config(critic / "huggingface", Path(base.path), "actor")
    _edit_config(critic, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="num_hidden_layers: 3 \\(base model: 2\\)"):
        check_model_config(critic / "huggingface", Path(base.path), "critic")


def test_num_examples_beyond_the_assigned_episodes_is_refused(suite: Suite, tmp_path: Path) -> None:
    strategy = _strategy(tmp_path, _base(tmp_path), clients=3)
    root = Path(strategy.run_root)
    # Default config: tinyguess trains 2 env instances per step, rollout_n 2, and the override
    # asked for 2 local steps: 8 episodes per client and round.
    assert strategy.assigned_examples(1, 0) == 8
    refs = [CheckpointRef.for_directory(suite.copy(name, root / "round_1" / f"client_{c}"))
            for c, name in enumerate(("qwen_a", "qwen_b", "qwen_c"))]
    entry = _round(strategy, [_reply(0, refs[0], 8), _reply(1, refs[1], 1e300), _reply(2, refs[2], 9)])
    assert entry["client_actor_ids"] == [0]
    assert entry["rejected"]["1"] == (
        "'num-examples' = 1e+300 is more than the 8 episodes client 1 was assigned this round")
    assert "'num-examples' = 9 is more than the 8 episodes client 2" in entry["rejected"]["2"]


def test_a_weight_that_is_not_a_number_refuses_that_client_only(suite: Suite, tmp_path: Path) -> None:
    """A MetricRecord may carry lists; a client weighing itself with one is refused, the run goes on."""
    strategy = _strategy(tmp_path, _base(tmp_path), clients=2)
    root = Path(strategy.run_root)
    refs = [CheckpointRef.for_directory(suite.copy(name, root / "round_1" / f"client_{c}"))
            for c, name in enumerate(("qwen_a", "qwen_b"))]
    entry = _round(strategy, [_reply(0, refs[0], 8), _reply(1, refs[1], [1.0, 2.0])])
    assert entry["client_actor_ids"] == [0]
    assert entry["rejected"]["1"] == "malformed reply: metric 'num-examples' = [1.0, 2.0] is not a number"


class _Connected:
    """The nodes connected to the SuperLink (``get_node_ids``: all a configure_* asks of a grid once
    every node is known to the strategy's registry)."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _evaluation_sent(strategy: FedAvgFSDP, server_round: int, nodes: list[int]) -> list[Message]:
    """The instructions ``configure_evaluate`` sends while ``nodes`` are connected."""
    grid = cast(Grid, _Connected(nodes))
    return list(strategy.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid))


def _evaluated(instruction: Message, reply: EvalReply) -> Message:
    """``reply`` as the node that ``instruction`` went to sends it."""
    return Message(reply.to_record(), reply_to=instruction)


def test_an_evaluation_reply_counting_more_episodes_than_assigned_is_refused(tmp_path: Path) -> None:
    """The validation seeds are split among the evaluating clients and the evaluation is the
    episode-weighted mean of their replies: a client reporting more episodes than its share would
    outweigh the others (here client 1's 300 successes would make the curve read ~0.98). Such a
    reply is refused naming the client, its node, what it reported and what it was assigned, as an
    over-counting train reply is; the honest clients' episodes are the evaluation."""
    strategy = _strategy(tmp_path, _base(tmp_path), clients=3)
    root = Path(strategy.run_root)
    sent = _evaluation_sent(strategy, 1, [100, 101, 102])
    # Default config: 8 validation seeds of one TinyGuess env, split 3/3/2 over the three clients.
    shares = [len(EvalInstruction.from_record(m.content).eval_seeds) for m in sent]
    assert [m.metadata.dst_node_id for m in sent] == [100, 101, 102] and shares == [3, 3, 2]
    replies = [_evaluated(sent[0], EvalReply(num_examples=3, success_rate=1 / 3, reward_mean=1.0)),
               _evaluated(sent[1], EvalReply(num_examples=300, success_rate=1.0, reward_mean=10.0)),
               _evaluated(sent[2], EvalReply(num_examples=3, success_rate=1.0, reward_mean=10.0))]
    eval_round(strategy, 1, replies, sent=[0, 1, 2])
    (point,) = json.loads((root / "federated_summary.json").read_text())["val_curve"]
    assert point["n"] == 3 and point["success_rate"] == pytest.approx(1 / 3), point  # client 0's episodes only
    assert point["failed"] == {
        "1": "malformed evaluation reply from client 1 (node 101): 'num-examples' = 300 is more than the 3 "
             "episode(s) it was assigned in this evaluation",
        "2": "malformed evaluation reply from client 2 (node 102): 'num-examples' = 3 is more than the 2 "
             "episode(s) it was assigned in this evaluation",
    }
    assert [strategy.assigned_eval_examples(1, c) for c in range(3)] == shares
    # Each round's own split: in round 2 two clients evaluate (4 seeds each), so client 1 may report 4
    # and client 2, sent nothing, no episode at all.
    sent = _evaluation_sent(strategy, 2, [100, 101])
    assert [strategy.assigned_eval_examples(2, c) for c in range(3)] == [4, 4, 0]
    assert strategy.assigned_eval_examples(1, 1) is None  # the split of round 1 is no longer kept
    metrics = strategy.aggregate_evaluate(2, [_evaluated(m, EvalReply(num_examples=4, success_rate=0.5,
                                                                      reward_mean=1.0)) for m in sent])
    assert metrics is not None and metrics["num-examples"] == 8 and strategy.evaluation_refused == {}
    # The evaluator plays every seed in every env of the validation spec: two envs, twice the episodes.
    two_envs = {"envs": [*strategy.plan.val_env_spec["envs"]] * 2}
    assert dataclasses.replace(strategy.plan, val_env_spec=two_envs).eval_episodes(4) == 8


@pytest.fixture(params=["shared-fs", "http"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerStore]:
    (tmp_path / "job").mkdir()
    if request.param == "shared-fs":
        yield SharedFsServerStore(tmp_path / "job")
    else:
        with HttpServerStore(StorageSettings(kind="http"), tmp_path / "job", RUN) as running:
            yield running


def test_a_client_answering_with_another_clients_checkpoint_is_refused(
        store: ServerStore, suite: Suite, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    strategy = _strategy(tmp_path, _base(tmp_path), clients=3, store=store)
    if isinstance(store, HttpServerStore):
        nodes = tmp_path_factory.mktemp("nodes")
        ref0 = node(store, nodes / "n0", 1, 0).put(suite.copy("qwen_a", nodes / "src0"), "actor", 1, 0)
        ref2 = node(store, nodes / "n2", 1, 2).put(suite.copy("qwen_c", nodes / "src2"), "actor", 1, 2)
        own_slot = "does not name its own upload slot of round 1"
    else:
        ref0 = CheckpointRef.for_directory(suite.copy("qwen_a", store.run_root / "round_1" / "client_0"))
        ref2 = CheckpointRef.for_directory(suite.copy("qwen_c", store.run_root / "round_1" / "client_2"))
        own_slot = f"is not in its own slot of round 1 ({store.run_root / 'round_1' / 'client_1'}/)"
    # Client 1 answers with client 0's checkpoint (to count it twice); client 2 answers in round 2
    # with its checkpoint of round 1.
    entry = _round(strategy, [_reply(0, ref0, 4), _reply(1, ref0, 4), _reply(2, ref2, 4)])
    assert entry["client_actor_ids"] == [0, 2]
    assert "client 1" in entry["rejected"]["1"] and own_slot in entry["rejected"]["1"]
    entry = _round(strategy, [_reply(2, ref2, 4)], server_round=2)
    assert entry["client_actor_ids"] == [] and "round 2" in entry["rejected"]["2"]


def test_with_the_http_store_a_round_takes_digests_from_receipts_and_refuses_a_file_changed_after_upload(
        suite: Suite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real strategy over a real http store: client 0's checkpoint is averaged from the store's
    receipt (its bytes are not hashed again), client 1's, changed on the server after its upload
    with the mtime put back, is hashed and refused; the same round without receipts hashes client 0
    as well and gives the same global model."""
    counter = HashCounter().install(monkeypatch)
    hashed, models, good, vouched = {}, {}, 0, 0
    for trust in (True, False):
        work = tmp_path / f"trust_{trust}"
        (work / "job").mkdir(parents=True)
        with HttpServerStore(StorageSettings(kind="http", trust_store_receipts=trust), work / "job", RUN) as store:
            strategy = _strategy(work, _base(work), clients=2, store=store)
            ref0 = node(store, work / "n0", 1, 0).put(suite.copy("qwen_a", work), "actor", 1, 0)
            ref1 = node(store, work / "n1", 1, 1).put(suite.copy("qwen_c", work), "actor", 1, 1)
            landed = store.run_root / "round_1"
            good = sum(p.stat().st_size for p in hashed_files(landed / "client_0" / "actor"))
            shard = sorted((landed / "client_1" / "actor").glob("model_world_size_*.pt"))[0]
            # client 1's files other than the changed one still match their receipt
            vouched = sum(p.stat().st_size for p in hashed_files(landed / "client_1" / "actor")) - shard.stat().st_size
            before = shard.stat()
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
            os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
            counter.bytes = 0
            entry = _round(strategy, [_reply(0, ref0, 4), _reply(1, ref1, 4)])
            hashed[trust] = counter.bytes
            assert entry["client_actor_ids"] == [0]
            assert "content hash of" in entry["rejected"]["1"] and "files changed" in entry["rejected"]["1"]
            models[trust] = load_file(str(Path(strategy.global_model.path) / "model.safetensors"))
    # Client 0 is read twice (the mean with client 1, which fails its check, then without it):
    # without receipts each pass hashes all its bytes, with them none; of client 1 (read once)
    # only the changed file is hashed with receipts.
    assert vouched > 0
    assert hashed[False] - hashed[True] == 2 * good + vouched
    assert models[True].keys() == models[False].keys()
    assert all(models[True][k].equal(models[False][k]) for k in models[True])
