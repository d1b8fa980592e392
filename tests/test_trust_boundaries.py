"""Trust boundaries, with real checkpoints, a real HTTP store on loopback and real Flower messages:
the server takes from a client only a reference inside the run's store (no '..', no symlink
escape, no foreign scheme, no other run, no other client's upload) carrying the right hash, and
refuses malformed or oversized replies by name while the round goes on with the good client; a
client takes only a global model of its own run; config strings that become paths, imports or
bind addresses are checked. Nothing is ever written outside the run root."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from omegaconf import OmegaConf

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef
from fedagent_flwr.checkpoint.http_server import HttpServerStore, upload_url
from fedagent_flwr.checkpoint.store import (
    ServerStore,
    SharedFsClientStore,
    SharedFsServerStore,
    StorageSettings,
    open_client_store,
)
from fedagent_flwr.clientapp.app import node_work_dir
from fedagent_flwr.clientapp.services import serve_env_spec, stop_client_services
from fedagent_flwr.config import ConfigError, compose_config, load_settings, validate
from fedagent_flwr.protocol import CLIENT_ID, CONFIG, METRICS, NUM_EXAMPLES
from fedagent_flwr.serverapp.recorder import RunRecorder
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.ckpt_factory import ModelSpec, Suite, write_hf_checkpoint
from testkit.round_harness import connect, train_round
from testkit.store_harness import RUN, SHARD, node, tree


def reply(client: int, config: dict[str, Any], metrics: dict[str, Any] | None = None,
          arrays: ArrayRecord | None = None) -> Message:
    """A train reply from client ``client``'s node (node 100 + client) with exactly this content."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # set by Flower in real runs
    instruction = Message(RecordDict(), dst_node_id=100 + client, message_type="train")
    # Raw records, not TrainReply.to_record(): these replies are malformed on purpose.
    records: dict[str, Any] = {CONFIG: ConfigRecord({CLIENT_ID: client, **config}),
                               METRICS: MetricRecord(metrics or {NUM_EXAMPLES: 4.0})}
    if arrays is not None:
        records["arrays"] = arrays
    return Message(RecordDict(records), reply_to=instruction)


def strategy_over(store: ServerStore, tmp_path: Path, clients: int) -> FedAvgFSDP:
    """FedAvgFSDP on ``store`` with every client selected and node 100 + c serving client c."""
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    initial = CheckpointRef.for_directory(tmp_path / "base")
    recorder = RunRecorder(store.run_root, {"base_model": initial.path, "mode": "federated"})
    strategy = FedAvgFSDP(run_root=str(store.run_root), initial_model=initial, num_clients=clients,
                          clients_per_round=clients, store=store)
    return connect(strategy, recorder, range(clients))


def run_round(strategy: FedAvgFSDP, replies: list[Message]) -> dict[str, Any]:
    entry = train_round(strategy, 1, replies)
    assert entry is not None
    return entry


def with_path(ref: CheckpointRef, path: str) -> dict[str, Any]:
    return CheckpointRef(**{**ref.__dict__, "path": path}).to_config("actor")


# -- the server: forged references -----------------------------------------------------------


def test_forged_references_on_a_shared_filesystem_are_refused_by_name(suite: Suite, tmp_path: Path) -> None:
    store = SharedFsServerStore(tmp_path / "run")
    strategy = strategy_over(store, tmp_path, clients=10)
    root = store.run_root
    good = CheckpointRef.for_directory(suite.copy("qwen_a", root / "round_1" / "client_0"))
    elsewhere = CheckpointRef.for_directory(suite.copy("qwen_a", tmp_path / "elsewhere"))
    (root / "round_1" / "client_3").mkdir(parents=True)
    (root / "round_1" / "client_3" / "actor").symlink_to(elsewhere.path, target_is_directory=True)
    linked_shard = suite.copy("qwen_a", root / "round_1" / "client_4")
    (linked_shard / SHARD).unlink()
    (linked_shard / SHARD).symlink_to(Path(elsewhere.path) / SHARD)
    other_run = CheckpointRef.for_directory(suite.copy("qwen_a", tmp_path / "run-other" / "round_1" / "client_8"))
    altered = CheckpointRef.for_directory(suite.copy("qwen_a", root / "round_1" / "client_5"))
    replies = [
        reply(0, good.to_config("actor")),
        reply(1, elsewhere.to_config("actor")),
        reply(2, with_path(elsewhere, f"{root}/round_1/../../elsewhere/qwen_a")),
        reply(3, with_path(elsewhere, str(root / "round_1" / "client_3" / "actor"))),
        reply(4, CheckpointRef.for_directory(linked_shard).to_config("actor")),
        reply(5, {**altered.to_config("actor"), "actor-sha256": "0" * 64}),
        reply(6, {**good.to_config("actor"), "actor-sha256": ""}),
        reply(7, with_path(good, "s3://bucket/run/round_1/client_7/actor")),
        reply(8, other_run.to_config("actor")),
        reply(9, with_path(good, f"file://{good.path}")),
    ]
    before = tree(tmp_path, skip=(root,))
    entry = run_round(strategy, replies)
    assert entry["client_actor_ids"] == [0]
    rejected = entry["rejected"]
    for client in ("1", "2", "3", "8"):
        assert "outside the run root" in rejected[client], rejected[client]
    assert f"{SHARD} links to" in rejected["4"] and "outside the run root" in rejected["4"]
    assert "content hash" in rejected["5"] and "the reference says 0000000000000000" in rejected["5"]
    assert "carries no sha256 content hash" in rejected["6"]
    assert "uses a scheme this run cannot read" in rejected["7"] and "uses a scheme" in rejected["9"]
    assert tree(tmp_path, skip=(root,)) == before  # nothing written outside the run root


@pytest.fixture
def http_store(tmp_path: Path) -> Iterator[HttpServerStore]:
    (tmp_path / "run").mkdir()
    with HttpServerStore(StorageSettings(kind="http"), tmp_path / "run", RUN) as running:
        yield running  # type: ignore[misc]


def test_forged_references_to_the_http_store_are_refused_by_name(
        http_store: HttpServerStore, suite: Suite, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    strategy = strategy_over(http_store, tmp_path, clients=10)
    nodes = tmp_path_factory.mktemp("nodes")  # the clients' own machines: not under tmp_path
    refs = {c: node(http_store, nodes / f"n{c}", 1, c).put(suite.copy("qwen_a", nodes / f"src{c}"), "actor", 1, c)
            for c in (0, 1, 2)}
    url, good = http_store.url, refs[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (http_store.run_root / "round_1" / "client_9").mkdir(parents=True)
    (http_store.run_root / "round_1" / "client_9" / "actor").symlink_to(outside, target_is_directory=True)
    replies = [
        reply(0, good.to_config("actor")),
        reply(1, {**refs[1].to_config("actor"), "actor-sha256": "0" * 64}),
        reply(2, refs[0].to_config("actor")),  # client 0's upload, claimed by client 2
        reply(3, with_path(good, upload_url(url, "12", 1, 3, "actor"))),
        reply(4, with_path(good, "http://10.9.9.9:8470" + upload_url(url, RUN, 1, 4, "actor")[len(url):])),
        reply(5, with_path(good, "s3://bucket" + upload_url(url, RUN, 1, 5, "actor")[len(url):])),
        reply(6, with_path(good, f"{url}/runs/{RUN}/uploads/1/6/../../../../etc")),
        reply(7, with_path(good, f"{url}/runs/{RUN}/uploads/1/%2e%2e/actor")),
        reply(8, with_path(good, upload_url(url, RUN, 1, 8, "actor"))),  # never uploaded
        reply(9, with_path(good, upload_url(url, RUN, 1, 9, "actor"))),  # slot is a symlink out
    ]
    before = tree(tmp_path, skip=(http_store.run_root,))
    entry = run_round(strategy, replies)
    assert entry["client_actor_ids"] == [0]
    assert entry["client_actors"] == [str(http_store.run_root / "round_1" / "client_0" / "actor")]
    rejected = entry["rejected"]
    assert "the reference says 0000000000000000" in rejected["1"]
    assert "does not name its own upload slot of round 1" in rejected["2"]
    assert "belongs to run 12, not to this run (11)" in rejected["3"]
    assert "is not on this run's store" in rejected["4"]
    assert "uses scheme 's3'" in rejected["5"]
    assert "malformed segment '..'" in rejected["6"]
    assert "malformed segment '%2e%2e'" in rejected["7"]
    assert "the upload was never committed" in rejected["8"]
    assert "outside the run root" in rejected["9"]
    assert tree(tmp_path, skip=(http_store.run_root,)) == before


# -- the server: malformed and oversized replies -------------------------------------------------


def test_malformed_and_oversized_replies_are_refused_and_the_round_goes_on(suite: Suite, tmp_path: Path) -> None:
    store = SharedFsServerStore(tmp_path / "run")
    strategy = strategy_over(store, tmp_path, clients=9)
    good = CheckpointRef.for_directory(suite.copy("qwen_a", store.run_root / "round_1" / "client_0"))
    ref = good.to_config("actor")
    weights = ArrayRecord({"w": Array(torch.zeros(4).numpy())})
    replies = [
        reply(0, ref),
        reply(1, {**ref, "actor-world-size": "1"}),
        reply(2, {**ref, "actor-path": [good.path]}),
        reply(3, {**ref, "actor-path": good.path + "/" + "x" * (1024 * 1024)}),
        reply(4, {**ref, "actor-sha256": "xyz"}),
        reply(5, ref, arrays=weights),
        reply(6, {k: v for k, v in ref.items() if k != "actor-sha256"}),
        reply(7, ref, metrics={"num-examples": 4.0, **{f"m{i}": float(i) for i in range(10000)}}),
        reply(8, {**ref, "actor-world-size": 1 << 40}),
    ]
    before = tree(tmp_path, skip=(store.run_root,))
    entry = run_round(strategy, replies)
    assert entry["client_actor_ids"] == [0]
    rejected = entry["rejected"]
    assert "'actor-world-size' must be int, got str" in rejected["1"]
    assert "'actor-path' must be str, got list" in rejected["2"]
    assert "exceeds the limit of 65536" in rejected["3"] and "exceeds the limit of 65536" in rejected["7"]
    assert "is not a sha256 hex digest" in rejected["4"]
    assert "reply carries arrays" in rejected["5"]
    assert "missing 'actor-sha256'" in rejected["6"]
    assert "world size must be in [1, 1048576]" in rejected["8"]
    assert tree(tmp_path, skip=(store.run_root,)) == before


# -- the client: only a global model of its own run ----------------------------------------------


def test_a_shared_fs_client_takes_only_models_of_its_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    server = SharedFsServerStore(tmp_path / "run")
    base = CheckpointRef.for_directory(tiny_model_dir)
    client = SharedFsClientStore(str(server.run_root))
    with pytest.raises(CheckpointError, match="is not a model of this run"):
        client.fetch(base)  # not shared (yet) by this run's server
    assert client.fetch(server.share(base)) == Path(base.path)  # the base model, once published
    other = CheckpointRef(**{**base.__dict__, "sha256": "1" * 64})  # same path, other content
    with pytest.raises(CheckpointError, match="is not a model of this run"):
        client.fetch(other)
    with pytest.raises(CheckpointError, match="uses a scheme"):
        client.fetch(CheckpointRef(**{**base.__dict__, "path": "s3://bucket/model"}))
    with pytest.raises(CheckpointError, match="must be an absolute path"):
        SharedFsClientStore("relative/run")
    with pytest.raises(CheckpointError, match="must be an absolute path"):
        SharedFsClientStore(f"{server.run_root}/../other")


def test_an_http_client_takes_only_models_of_its_run(http_store: HttpServerStore, tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    shared = http_store.share(CheckpointRef.for_directory(tiny_model_dir))
    url = http_store.url
    client = node(http_store, tmp_path / "node0")

    def forged(**fields: Any) -> CheckpointRef:
        return CheckpointRef(**{**shared.__dict__, **fields})

    cases = [
        (forged(path=shared.path.replace(f"/runs/{RUN}/", "/runs/12/")), "belongs to run 12, not to this run"),
        (forged(path=shared.path.replace(url, "https://10.9.9.9:8470")), "uses scheme 'https'"),
        (forged(path=shared.path.replace(url, "http://10.9.9.9:8470")), "is not on this run's store"),
        (forged(path="file://" + str(tiny_model_dir)), "uses scheme 'file'"),
        (forged(path=upload_url(url, RUN, 1, 0, "actor")), "names no shared model"),
        (forged(path=f"{url}/runs/{RUN}/models/../../x"), "malformed segment '..'"),
        (forged(sha256=""), "is not a sha256 hex digest"),
    ]
    for ref, message in cases:
        with pytest.raises(CheckpointError, match=message):
            client.fetch(ref)
    assert not (tmp_path / "node0" / "cache").exists() or not os.listdir(tmp_path / "node0" / "cache")
    assert client.fetch(shared).is_dir()  # the genuine reference works


def test_an_instruction_of_another_run_is_refused(http_store: HttpServerStore, tmp_path: Path) -> None:
    fields = http_store.instruction_fields()
    with pytest.raises(CheckpointError, match="instruction for run 11 reached this node in run 12"):
        open_client_store(fields, 12, lambda: tmp_path)
    assert open_client_store(fields, 11, lambda: tmp_path).run_root == tmp_path / "run-11"
    with pytest.raises(CheckpointError, match="unknown store kind 'ftp'"):
        open_client_store({**fields, "store-kind": "ftp"}, 11, lambda: tmp_path)


@pytest.mark.parametrize("value", ["relative/dir", "/tmp/with\nnewline"])
def test_a_node_work_dir_must_be_an_absolute_path(value: str) -> None:
    context = Context(run_id=1, node_id=1, node_config={"work-dir": value}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="node config 'work-dir'"):
        node_work_dir(context)


# -- config strings that become paths, imports and bind addresses --------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run_name=../escape", "config key 'run_name'"),
        ("run_name=a/b", "config key 'run_name'"),
        ("run_name=.hidden", "config key 'run_name'"),
        ("strategy.class_path=mypkg.rm-rf.Strategy", "config key 'strategy.class_path'"),
        ("storage.kind=ftp", "config key 'storage.kind'"),
        ("storage.kind=s3 storage.url=s3://my-bucket/../x", "config key 'storage.url'"),
        ("storage.kind=http storage.host=0.0.0.0", "exposes the checkpoint store beyond this machine"),
        ("storage.kind=http storage.ssl_certfile=/no/such.pem", "config key 'storage.ssl_certfile'"),
        ("storage.kind=http storage.url=ftp://10.0.0.5", "config key 'storage.url'"),
        ("storage.port=70000", "config key 'storage.port'"),
        ("env.service.host=bad_host", "config key 'env.service.host'"),
    ],
)
def test_config_strings_that_become_paths_imports_or_binds_are_checked(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides=override)


@pytest.mark.parametrize("key", ["output_dir", "model.path"])
def test_paths_with_control_characters_are_refused(key: str) -> None:
    cfg = compose_config()
    OmegaConf.update(cfg, key, "/data/run\n; rm -rf /")
    with pytest.raises(ConfigError, match=f"config key '{key}' .* holds control characters"):
        validate(cfg)


def test_services_and_the_store_bind_to_loopback_by_default(tmp_path: Path) -> None:
    settings = load_settings(overrides="env=tinyguess_service")
    assert settings.storage.host == "127.0.0.1" and settings.storage.kind == "shared-fs"
    assert settings.run.env.service.host == "127.0.0.1"
    spec, managers = serve_env_spec(settings.train_env_spec, split="train", run_root=tmp_path, client_id=0,
                                    settings=asdict(settings.run.env.service), partition={"strategy": "none"})
    try:
        assert managers[0].url.startswith("http://127.0.0.1:")
        assert spec["envs"][0]["config"]["url"] == managers[0].url
    finally:
        stop_client_services(tmp_path, 0)


def test_a_custom_rule_that_checks_no_hash_still_gets_no_altered_checkpoint(suite: Suite, tmp_path: Path) -> None:
    """Hashes are checked while reading; a user's aggregation rule that writes its output without
    the built-in mean (which verifies before it renames) must not commit an altered checkpoint:
    the strategy verifies every source afterwards, refuses the culprit and aggregates again."""
    import shutil

    from fedagent_flwr.checkpoint.aggregate import AggregateReport

    class CopiesTheFirst(FedAvgFSDP):
        """Takes the first client's weights as they are read, never calling verify_content()."""

        def aggregate_checkpoints(self, server_round, sources, out_dir, reference):  # type: ignore[no-untyped-def]
            from safetensors.torch import save_file

            first = sources[0][0]
            shutil.copytree(first.huggingface_dir(), out_dir)
            save_file({key: first.read(key).contiguous() for key in first.keys()}, str(out_dir / "model.safetensors"))
            return AggregateReport(out_dir, 0, 0, tuple(w for _, w in sources), 0, 0.0)

    store = SharedFsServerStore(tmp_path / "run")
    write_hf_checkpoint(ModelSpec("global", "qwen2", seed=9), tmp_path / "base")
    initial = CheckpointRef.for_directory(tmp_path / "base")
    strategy = connect(CopiesTheFirst(run_root=str(store.run_root), initial_model=initial, num_clients=2,
                                      clients_per_round=2, store=store),
                       RunRecorder(store.run_root, {"base_model": initial.path, "mode": "federated"}), range(2))
    root = store.run_root
    altered = CheckpointRef.for_directory(suite.copy("qwen_a", root / "round_1" / "client_0"))
    good = CheckpointRef.for_directory(suite.copy("qwen_b", root / "round_1" / "client_1"))
    with open(Path(altered.path) / SHARD, "r+b") as handle:  # one byte changed after the reference was made
        handle.seek(os.path.getsize(Path(altered.path) / SHARD) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    entry = run_round(strategy, [reply(0, altered.to_config("actor")), reply(1, good.to_config("actor"))])
    assert entry["client_actor_ids"] == [1]
    assert "content hash" in entry["rejected"]["0"], entry["rejected"]
    from fedagent_flwr.checkpoint import open_checkpoint

    written_ref = CheckpointRef.for_directory(entry["aggregated_actor"], "actor", "hf-safetensors")
    with open_checkpoint(good) as source, open_checkpoint(written_ref) as written:
        assert all(torch.equal(written.read(key), source.read(key)) for key in source.keys())  # client 1's


def test_a_bad_state_file_does_not_keep_the_other_services_running(tmp_path: Path) -> None:
    """The end-of-run shutdown stops every recorded env service: the hidden temporary file a killed
    atomic write left behind is not a state file, and an unreadable state file is reported and
    skipped, not allowed to stop the loop (and the persistent trainer's stop after it)."""
    from fedagent_flwr.clientapp.services import services_dir
    from fedagent_flwr.procs import ProcessRef

    settings = load_settings(overrides="env=tinyguess_service")
    _, managers = serve_env_spec(settings.train_env_spec, split="train", run_root=tmp_path, client_id=0,
                                 settings=asdict(settings.run.env.service), partition={"strategy": "none"})
    service = ProcessRef.from_json(json.loads(managers[0].state_file.read_text()))
    assert service is not None and service.process() is not None
    folder = services_dir(tmp_path, 0)
    (folder / ".train_0.json.1a2b3c4d.json").write_text("")  # a killed write's leftover, sorted first
    (folder / "a_broken.json").write_text("{not json")  # an unreadable one, also before the real one
    try:
        assert stop_client_services(tmp_path, 0) == ["train_0.json"]
        assert not managers[0].state_file.exists()
        assert service.process() is None, "the service outlived the shutdown"
    finally:
        managers[0].stop()


def test_the_service_of_an_unreadable_state_file_is_stopped_at_shutdown_all_the_same(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A state file damaged after its service started (here cut short) names no pid any more: the
    shutdown finds the service by the marker it was started with, stops it and reports the file."""
    from fedagent_flwr.procs import ProcessRef

    settings = load_settings(overrides="env=tinyguess_service")
    _, managers = serve_env_spec(settings.train_env_spec, split="train", run_root=tmp_path, client_id=0,
                                 settings=asdict(settings.run.env.service), partition={"strategy": "none"})
    state_file = managers[0].state_file
    service = ProcessRef.from_json(json.loads(state_file.read_text()))
    assert service is not None and service.process() is not None
    state_file.write_text(state_file.read_text()[:30])
    try:
        with caplog.at_level(logging.WARNING):
            assert stop_client_services(tmp_path, 0) == []
        assert service.process() is None, "the service outlived the shutdown"
        assert f"{state_file} is unreadable" in caplog.text and f"(pid {service.pid}) was stopped" in caplog.text
        assert not state_file.exists() and state_file.with_name("train_0.json.unreadable").exists()
    finally:
        left = service.process()
        if left is not None:  # the state file cannot stop it any more
            left.kill()
