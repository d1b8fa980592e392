"""End to end in Flower's deployment runtime: a real SuperLink and two real SuperNodes on
loopback, with TLS (a self-signed CA generated here) and SuperNode authentication, running the
job with the tiny model, once on a shared filesystem with the persistent trainer and the
service-backed environment (each node's env services started by one message and found again by
the later ones) and once with the default in-process environment through the http checkpoint
store with no shared path (where the clients' step lines, too, can only reach the ServerApp's log
through the store); and a SuperNode whose key was never registered is refused.
The fast tests at the end check the generated certificates, keys and connection config."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.checkpoint.manifest import build_manifest
from fedagent_flwr.deploy import connection_toml, make_node_key, make_tls_files
from fedagent_flwr.procs import ProcessRef, pids_with_cmdline
from testkit.audit import audit_run
from testkit.deployment_harness import CONNECTION, Deployment, tls_deployment
from testkit.run_end import ran_every_round


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # SuperNode 1 bounds its http-store cache to one model (node config cache-keep); 0 keeps all.
    with tls_deployment(tmp_path_factory.mktemp("deploy"), num_supernodes=2,
                        extra_node_config={1: "cache-keep=1"}) as running:
        yield running
    # Stopped by process group: nothing started in the deployment's directories survives. Processes
    # re-parented out of it (the SuperLink's SuperExec) may take a moment to exit under load.
    deadline = time.monotonic() + 60
    while running.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = running.leftovers()
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for pid in left]


@pytest.mark.slow
def test_two_supernodes_with_tls_and_node_auth_run_two_rounds(
    deployment: Deployment, tmp_path: Path, tiny_model_dir: Path
) -> None:
    # The persistent trainer and the env services here (the http-store test below uses subprocess
    # mode and the in-process env): every message runs in a fresh flwr-clientapp process, so each
    # must find the node's trainer and its services again.
    proc = deployment.run(
        f"model.path={tiny_model_dir} num_rounds=2 eval.num_episodes=2 trainer.max_new_tokens=8 "
        f"output_dir={tmp_path} run_name=job trainer.mode=persistent storage.keep_client_checkpoints=true "
        "env=tinyguess_service partition.min_goals_per_client=5"  # 5 of the 10 secrets to each client
    )
    output = proc.stdout + proc.stderr
    run_dir = tmp_path / "job"
    summary_path = run_dir / "federated_summary.json"
    assert summary_path.exists(), output[-4000:] + deployment.logs()
    summary = json.loads(summary_path.read_text())
    assert ran_every_round(summary), output[-4000:] + deployment.logs()
    assert summary["mode"] == "federated" and summary["strategy"] == "fedavg"
    assert [p["round"] for p in summary["val_curve"]] == [0, 1, 2]
    assert [entry["round"] for entry in summary["rounds"]] == [1, 2]
    previous = str(Path(tiny_model_dir).resolve())
    for entry in summary["rounds"]:
        assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"]
        assert entry["started_from"] == previous
        previous = entry["aggregated_actor"]
    assert summary["final_model"] == previous
    # One trainer per node served both rounds and the evaluations; the run's end stopped them (and
    # the fixture checks that no process is left in the deployment's directories).
    for client in (0, 1):
        starts = (run_dir / "trainers" / f"client_{client}" / "starts.jsonl").read_text().splitlines()
        assert len(starts) == 1, starts
        # It watched its SuperNode's ClientApp launcher, which outlives each flwr-clientapp (and is
        # still up: the SuperNodes run on), so the trainer would end with the node, not the message.
        watch = json.loads(starts[0])["watch"]
        assert watch["name"] == "flower-superexe" and (
            ProcessRef(watch["pid"], watch["since_boot"], watch["boot"]).alive()), starts
    # ... and one train and one validation service per node served every message of the run: each
    # started once (one start line in its log, appended to by every start), by the first message
    # that needed it, and every later job played against that same service (its URL, a port the
    # kernel chose at its start). They watched the SuperNode, not the message's short-lived
    # process (they would have gone with it, and the next message started another), and were
    # stopped by the run's final message while the SuperNodes run on.
    assert "run over: 2 node(s) told, 4 env service(s) and 2 persistent trainer(s) stopped" in output, \
        output[-4000:]
    partitions = {}
    for client in (0, 1):
        services = run_dir / "services" / f"client_{client}"
        logs = sorted(p.name for p in services.glob("*.log"))
        assert logs == ["train_0.json.log", "val_0.json.log"], logs
        for name in logs:
            log = (services / name).read_text()
            assert log.count("=== starting env service TinyGuess ") == 1, log[-2000:]
            assert "owner process" not in log, log[-2000:]  # what it watched (the SuperNode) ran on
        assert not list(services.glob("*.json")), list(services.iterdir())  # stopped, forgotten
        train_urls = set()
        for server_round in (1, 2):
            client_dir = run_dir / f"round_{server_round}" / f"client_{client}"
            (health,) = json.loads((client_dir / "service_health.json").read_text())
            assert health["ready"] and health["env"] == "TinyGuess", health
            assert health["partition"]["client_id"] == client, health
            partitions.setdefault(client, health["partition"]["goal_indices"])
            assert health["partition"]["goal_indices"] == partitions[client], health  # the same world
            # The trainer played only over HTTP, against this node's service, and played episodes.
            (served,) = json.loads((client_dir / "train_job.json").read_text())["env_spec"]["envs"]
            assert served["name"] == "Service", served
            train_urls.add(served["config"]["url"])
            assert json.loads((client_dir / "train_result.json").read_text())["num_episodes"] > 0
        val_urls = set()
        for server_round in (0, 1, 2):
            eval_dir = run_dir / f"round_{server_round}" / "eval" / f"client_{client}"
            (served,) = json.loads((eval_dir / "evaluate_job.json").read_text())["env_spec"]["envs"]
            assert served["name"] == "Service", served
            val_urls.add(served["config"]["url"])
            assert json.loads((eval_dir / "eval_result.json").read_text())["num_episodes"] > 0
        assert len(train_urls) == 1 and len(val_urls) == 1 and train_urls != val_urls, (train_urls, val_urls)
    assert partitions == {0: [0, 1, 2, 3, 4], 1: [5, 6, 7, 8, 9]}  # each node's service, its own slice
    # None outlives the run's end, while the SuperNodes run on. (The services inherit their
    # SuperNode's working directory, so the fixture's check after the SuperNodes stop counts them
    # too; this one finds them by the run directory in their command line.)
    assert pids_with_cmdline(str(run_dir / "services")) == []
    # Each message ran in a fresh flwr-clientapp process under its SuperNode.
    for node in deployment.supernodes:
        log = node.log()
        assert "Receiving: train message" in log and "Start `flwr-clientapp` process" in log, log[-2000:]
    audit = audit_run(run_dir)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.count(" ok") == 2


@pytest.fixture(scope="module")
def http_store_run(deployment: Deployment, tiny_model_dir: Path) -> tuple[dict, Path, str]:
    """The job through the http store (2 rounds of 2 local steps), run once for the two tests that
    read it: checkpoints exchanged through the store, and step lines relayed through it. Returns
    its summary, run directory and ``flwr run`` output."""
    tls = deployment.tls
    server_out = deployment.root / "superlink" / "outputs"
    proc = deployment.run(
        f"model.path={tiny_model_dir} num_rounds=2 train.local_steps=2 eval.num_episodes=2 trainer.max_new_tokens=8 "
        f"output_dir={server_out} run_name=no-shared-fs storage.kind=http storage.host=127.0.0.1 "
        f"storage.ssl_certfile={tls.server_cert} storage.ssl_keyfile={tls.server_key} "
        f"storage.ssl_ca_certfile={tls.ca_cert} storage.keep_client_checkpoints=true"
    )
    output = proc.stdout + proc.stderr
    run_dir = server_out / "no-shared-fs"
    summary_path = run_dir / "federated_summary.json"
    assert summary_path.exists(), output[-4000:] + deployment.logs()
    summary = json.loads(summary_path.read_text())
    assert ran_every_round(summary), output[-4000:] + deployment.logs()
    return summary, run_dir, output


@pytest.mark.slow
def test_two_supernodes_without_a_shared_filesystem_exchange_checkpoints_through_the_store(
    deployment: Deployment, http_store_run: tuple[dict, Path, str]
) -> None:
    """The http store over TLS: the server's run directory and each SuperNode's ``work-dir`` share
    no path; the clients download the global model and upload their checkpoints, and each round's
    aggregate is the num-episodes weighted mean of the checkpoints the clients wrote locally."""
    summary, run_dir, _ = http_store_run
    assert [p["round"] for p in summary["val_curve"]] == [0, 1, 2]
    nodes = deployment.supernodes[:2]
    for entry in summary["rounds"]:
        server_round = entry["round"]
        assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"], entry
        # What the server averaged are the uploads it received, inside its own run directory ...
        assert entry["client_actors"] == [str(run_dir / f"round_{server_round}" / f"client_{c}" / "actor")
                                          for c in (0, 1)]
        expected: dict[str, torch.Tensor] = {}
        total = 0.0
        for node in nodes:
            local = (node.store_dir / f"run-{summary['run_id']}" / f"round_{server_round}"
                     / f"client_{node.partition_id}")
            # ... copies of what each client wrote in its own directory, from a model it downloaded
            # into its own cache (never a server path).
            job = json.loads((local / "train_job.json").read_text())
            assert Path(job["model_path"]).parent == node.store_dir / "cache", job["model_path"]
            result = json.loads((local / "train_result.json").read_text())
            actor = Path(result["actor_dir"])
            assert node.store_dir in actor.parents
            uploaded = run_dir / f"round_{server_round}" / f"client_{node.partition_id}" / "actor"
            assert build_manifest(uploaded) == build_manifest(actor)
            # The weighted mean, computed here from the clients' own files, in float64.
            weight = float(result["num_episodes"])
            total += weight
            state = torch.load(actor / "model_world_size_1_rank_0.pt", weights_only=True)
            for key, tensor in state.items():
                expected[key] = expected.get(key, 0) + weight * tensor.double()
        aggregate = load_file(str(Path(entry["aggregated_actor"]) / "model.safetensors"))
        assert aggregate and set(aggregate) <= set(expected)
        error = max((aggregate[k].double() - expected[k] / total).abs().max().item() for k in aggregate)
        assert error < 1e-6, error
    # Only the server's run directory holds run outputs; the nodes' directories hold their own.
    for node in nodes:
        assert not (node.workdir / "outputs").exists()
    cached = [sorted(p.name for p in (node.store_dir / "cache").iterdir() if p.is_dir()) for node in nodes]
    assert len(cached[0]) == 3, cached  # the base model and the two aggregates, each fetched once
    # Node 1 (cache-keep=1) dropped the base model when round 1's aggregate came (evaluation of
    # round 1), and that one when round 2's came: only the last global model is left.
    assert cached[1] == [summary["rounds"][-1]["aggregated_sha256"]] and cached[1][0] in cached[0], cached
    assert nodes[1].log().count("[store] node cache: removed 1 older global model(s)") == 2, nodes[1].log()[-3000:]
    assert "[store] node cache" not in nodes[0].log()
    audit = audit_run(run_dir)
    assert audit.returncode == 0 and audit.stdout.count(" ok") == 2, audit.stdout + audit.stderr


@pytest.mark.slow
def test_http_store_clients_step_lines_reach_the_serverapps_log(http_store_run: tuple[dict, Path, str]) -> None:
    """No path is shared between the server's run directory and the nodes' work dirs, so each
    client's step lines can only reach the ServerApp's log through the store."""
    _, _, output = http_store_run
    for server_round in (1, 2):
        for client in (0, 1):
            for step in (1, 2):
                # the relayed line; the nodes' own lines ("[client 0 round 1] step 1/2 episodes ...")
                # stay in the SuperNodes' logs
                assert f"client {client} round {server_round}: step {step}/2, success " in output, output[-4000:]


@pytest.mark.slow
def test_a_supernode_with_an_unregistered_key_is_refused(deployment: Deployment) -> None:
    intruder = deployment.start_supernode(0, 2, deployment.new_node_key("intruder"), name="intruder")
    returncode = intruder.process.wait(timeout=300)  # a hang guard: refusal comes at the first contact
    log = intruder.log()
    assert returncode != 0, log
    assert "Exit Code: 305" in log and "Failed to activate SuperNode" in log, log
    nodes = deployment.flwr("supernode", "ls", CONNECTION, "--format", "json")
    assert nodes.returncode == 0, nodes.stdout + nodes.stderr
    listed = json.loads(nodes.stdout[nodes.stdout.index("{"):])["nodes"]
    # Only the two registered SuperNodes are known to the SuperLink, both online.
    registered = {line.rsplit(":", 1)[1].strip() for node in deployment.supernodes[:2]
                  for line in node.log().splitlines() if "SuperNode ID:" in line}
    assert {n["node-id"] for n in listed} == registered and len(registered) == 2, listed
    assert {n["status"] for n in listed} == {"online"}, listed


def test_tls_files_chain_to_the_ca_and_name_the_hosts(tmp_path: Path) -> None:
    import ipaddress

    from cryptography import x509

    files = make_tls_files(tmp_path, hosts=("127.0.0.1", "superlink.example.org"))
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert files.server_key.stat().st_mode & 0o777 == 0o600


def _assert_valid_node_key(private_path: Path, public_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    private = load_ssh_private_key(private_path.read_bytes(), password=None)
    public = load_ssh_public_key(public_path.read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert private.public_key().public_numbers() == public.public_numbers()
    assert private_path.stat().st_mode & 0o777 == 0o600
    assert public_path.stat().st_mode & 0o777 == 0o644


def test_node_keys_are_ec_in_openssh_format(tmp_path: Path) -> None:
    pair = make_node_key(tmp_path / "node")
    _assert_valid_node_key(pair.private_key, pair.public_key)


def _snapshot(directory: Path) -> dict[str, tuple[bool, bytes, int]]:
    """Every entry's (is a link, content or link target, mode), to show nothing changed."""
    out = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink():
            out[entry.name] = (True, str(entry.readlink()).encode(), 0)
        else:
            out[entry.name] = (False, entry.read_bytes(), entry.stat().st_mode & 0o777)
    return out


def test_node_key_never_overwrites_an_existing_key_unless_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`deploy node-key ~/.ssh/id_ecdsa` must not silently replace the user's key: any existing file
    of the pair refuses the whole pair (nothing written); --force replaces both."""
    from fedagent_flwr.deploy import main

    keys = tmp_path / "keys"
    keys.mkdir()
    key, pub = keys / "id_ecdsa", keys / "id_ecdsa.pub"
    key.write_bytes(b"the user's own private key\n")
    key.chmod(0o600)
    pub.write_bytes(b"ecdsa-sha2-nistp384 AAAA the user's own public key\n")
    before = _snapshot(keys)

    assert main(["node-key", str(key)]) == 2
    err = capsys.readouterr().err
    assert str(key) in err and str(pub) in err and "--force" in err, err
    assert _snapshot(keys) == before  # both byte-identical, no temporary file left

    # only the .pub exists: still refused, and the private key is not created either
    key.unlink()
    before = _snapshot(keys)
    assert main(["node-key", str(key)]) == 2
    err = capsys.readouterr().err
    assert str(pub) in err and "--force" in err, err
    assert _snapshot(keys) == before

    key.write_bytes(b"the user's own private key\n")
    assert main(["node-key", str(key), "--force"]) == 0
    _assert_valid_node_key(key, pub)
    assert sorted(p.name for p in keys.iterdir()) == ["id_ecdsa", "id_ecdsa.pub"]  # no temporary file left


def test_node_key_never_writes_through_a_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link at the target counts as existing (even a dangling one); --force replaces the link
    itself, never the file it points to."""
    from fedagent_flwr.deploy import main

    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"someone else's file\n")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "node").symlink_to(elsewhere)
    (keys / "node.pub").symlink_to(tmp_path / "missing")  # dangling
    before = _snapshot(keys)
    assert main(["node-key", str(keys / "node")]) == 2
    assert "--force" in capsys.readouterr().err
    assert _snapshot(keys) == before and not (tmp_path / "missing").exists()

    assert main(["node-key", str(keys / "node"), "--force"]) == 0
    assert not (keys / "node").is_symlink() and not (keys / "node.pub").is_symlink()
    _assert_valid_node_key(keys / "node", keys / "node.pub")
    assert elsewhere.read_bytes() == b"someone else's file\n" and not (tmp_path / "missing").exists()


def test_tls_never_overwrites_a_deployed_directory_unless_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CA's private key is not kept, so replacing ca.crt loses the old deployment's trust: any
    one of the files existing refuses the whole set (nothing written); --force replaces them."""
    from cryptography import x509

    from fedagent_flwr.deploy import main

    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "server.pem").write_bytes(b"the deployed server certificate\n")
    (certs / "notes.txt").write_bytes(b"unrelated\n")
    before = _snapshot(certs)
    assert main(["tls", str(certs), "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert str(certs / "server.pem") in err and "--force" in err, err
    assert str(certs / "ca.crt") not in err and str(certs / "server.key") not in err, err  # only what exists
    assert _snapshot(certs) == before  # ca.crt and server.key not written either

    assert main(["tls", str(certs), "--host", "127.0.0.1", "--force"]) == 0
    assert sorted(p.name for p in certs.iterdir()) == ["ca.crt", "notes.txt", "server.key", "server.pem"]
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    x509.load_pem_x509_certificate((certs / "server.pem").read_bytes()).verify_directly_issued_by(ca)
    assert (certs / "server.key").stat().st_mode & 0o777 == 0o600
    assert (certs / "notes.txt").read_bytes() == b"unrelated\n"


def test_connection_config_is_tls_unless_insecure_is_explicit(tmp_path: Path) -> None:
    import tomllib

    text = connection_toml("site", "10.0.0.5:8000", root_certificates=tmp_path / "ca.crt")
    parsed = tomllib.loads(text)["superlink"]
    assert parsed["default"] == "site"
    assert parsed["site"] == {"address": "10.0.0.5:8000", "root-certificates": str((tmp_path / "ca.crt").resolve())}
    assert tomllib.loads(connection_toml("local", "127.0.0.1:8000", insecure=True))["superlink"]["local"]["insecure"]
    with pytest.raises(ValueError, match="either root_certificates"):
        connection_toml("site", "10.0.0.5:8000")
    with pytest.raises(ValueError, match="either root_certificates"):
        connection_toml("site", "10.0.0.5:8000", root_certificates="ca.crt", insecure=True)
    with pytest.raises(ValueError, match="connection name"):
        connection_toml("a.b", "10.0.0.5:8000", insecure=True)
    # any string value round-trips: quotes, backslashes and control characters are escaped
    odd = 'C:\\certs\\"ca"\n\t.crt'
    assert tomllib.loads(connection_toml("site", odd, insecure=True))["superlink"]["site"]["address"] == odd


def test_connection_is_merged_into_the_flower_config_never_replacing_it(tmp_path: Path) -> None:
    """`deploy connection` keeps Flower's own `local` connection (the README's `flwr run .` needs it)
    and the user's others; a name clash is an error unless --force; Flower parses the result."""
    import tomllib

    from flwr.cli.flower_config import parse_superlink_connection

    from fedagent_flwr.deploy import main, write_connection

    home = tmp_path / "flwr-home"
    # a fresh home starts from Flower's own default configuration
    path = write_connection(home, "site-a", "10.0.0.5:8000", insecure=True)
    config = tomllib.loads(path.read_text())["superlink"]
    assert config["default"] == "site-a"
    assert config["local"] == {"address": ":local:"} and "supergrid" in config
    # an existing file (here: Flower's default plus a user's connection) is merged
    make_tls_files(tmp_path, hosts=("127.0.0.1",))  # the ca.crt a TLS connection must name
    path.write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
                    '[superlink.mine]\naddress = "192.168.1.2:9093"\ninsecure = true\n')
    assert main(["connection", str(home), "site-b", "10.0.0.6:8000", "--root-certificates",
                 str(tmp_path / "ca.crt"), "--no-default"]) == 0
    config = tomllib.loads(path.read_text())["superlink"]
    assert config["default"] == "local"
    assert config["mine"] == {"address": "192.168.1.2:9093", "insecure": True}
    assert config["site-b"]["root-certificates"] == str((tmp_path / "ca.crt").resolve())
    assert parse_superlink_connection(config["site-b"], "site-b").address == "10.0.0.6:8000"
    before = path.read_text()
    with pytest.raises(ValueError, match="already has a connection named 'mine'.*--force"):
        write_connection(home, "mine", "10.0.0.7:8000", insecure=True)
    assert main(["connection", str(home), "mine", "10.0.0.7:8000", "--insecure"]) == 2
    assert path.read_text() == before  # refused: nothing written
    write_connection(home, "mine", "10.0.0.7:8000", insecure=True, force=True)
    config = tomllib.loads(path.read_text())["superlink"]
    assert config["mine"]["address"] == "10.0.0.7:8000" and config["default"] == "mine"
    assert config["local"] == {"address": ":local:"}
    assert sorted(p.name for p in home.iterdir()) == ["config.toml"]  # no temporary file left
    path.chmod(0o600)  # a user's private config stays private
    write_connection(home, "site-c", "10.0.0.8:8000", insecure=True)
    assert path.stat().st_mode & 0o777 == 0o600


def test_connection_keeps_the_users_comments_and_a_linked_config_stays_a_link(tmp_path: Path) -> None:
    """`deploy connection` edits ``config.toml`` rather than rewriting it: the user's comments and
    order survive, also where a connection is added before another tool's table or replaced with
    --force (tomlkit files the comments above a header under the table before it), and a
    ``config.toml`` that links to a file kept elsewhere stays that link (the file it points to gets
    the new connection). A link to nothing is refused by name, and nothing is created."""
    import tomllib

    from flwr.cli.flower_config import parse_superlink_connection

    from fedagent_flwr.deploy import write_connection

    kept = tmp_path / "dotfiles" / "flower.toml"
    kept.parent.mkdir()
    kept.write_text('# my Flower settings, kept in dotfiles\n[superlink]\ndefault = "local"  # the simulation\n\n'
                    '[superlink.local]\naddress = ":local:"\n\n# the lab cluster, via the VPN\n'
                    '[superlink.lab]\naddress = "10.1.0.2:9093"\ninsecure = true\n\n'
                    '# settings of another tool\n[tool.other]\nlevel = 3\n')
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").symlink_to("../dotfiles/flower.toml")  # a relative link
    make_tls_files(tmp_path, hosts=("127.0.0.1",))  # the ca.crt a TLS connection must name
    write_connection(home, "site", "10.0.0.5:8000", root_certificates=tmp_path / "ca.crt")
    write_connection(home, "local", "127.0.0.1:9093", insecure=True, make_default=False, force=True)
    assert (home / "config.toml").is_symlink() and (home / "config.toml").resolve() == kept
    text = kept.read_text()
    for comment in ("# my Flower settings, kept in dotfiles", "# the simulation"):
        assert comment in text
    # each comment still stands above the header it was written for (tomlkit puts a blank line
    # between them where it replaces the table before, a cosmetic change only)
    assert re.search(r"# the lab cluster, via the VPN\n\n?\[superlink\.lab\]\n", text), text
    assert "# settings of another tool\n[tool.other]\n" in text
    assert text.index("[superlink.local]") < text.index("[superlink.lab]") < text.index("[superlink.site]")
    assert text.endswith("\n") and not text.endswith("\n\n")
    config = tomllib.loads(text)
    assert config["tool"] == {"other": {"level": 3}}
    connections = config["superlink"]
    assert connections["default"] == "site" and connections["lab"] == {"address": "10.1.0.2:9093", "insecure": True}
    assert connections["local"] == {"address": "127.0.0.1:9093", "insecure": True}
    assert parse_superlink_connection(connections["site"], "site").address == "10.0.0.5:8000"
    assert sorted(p.name for p in kept.parent.iterdir()) == ["flower.toml"]  # no temporary file left

    # a file that is not TOML is named and left as it was
    kept.write_text("[superlink\n")
    with pytest.raises(ValueError, match=r"flower\.toml is not valid TOML.*fix or move it away"):
        write_connection(home, "other", "10.0.0.6:8000", insecure=True)
    assert kept.read_text() == "[superlink\n"
    # a link to nothing: named, and no folder made where it points
    dangling = tmp_path / "dangling-home"
    dangling.mkdir()
    (dangling / "config.toml").symlink_to(tmp_path / "unmounted" / "flower.toml")
    with pytest.raises(ValueError, match=r"config\.toml is a link to .*unmounted.*fix or remove the link"):
        write_connection(dangling, "site", "10.0.0.5:8000", insecure=True)
    assert not (tmp_path / "unmounted").exists()


@pytest.mark.parametrize("shape", ['superlink.default = "local"\nsuperlink.local.address = ":local:"\n',
                                   'superlink = { default = "local", local = { address = ":local:" } }\n'],
                         ids=["dotted-keys", "inline-table"])
def test_a_config_whose_layout_cannot_be_kept_keeps_its_values(tmp_path: Path, shape: str) -> None:
    """``superlink`` written as dotted keys or an inline table: tomlkit cannot add a table there
    without changing what the other lines mean, so the file is written from its values (every
    connection kept) with a warning that its comments are gone, never edited into something else."""
    import tomllib

    from fedagent_flwr.deploy import write_connection

    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text("# mine\n" + shape)
    with pytest.warns(UserWarning, match="layout could not be kept.*without its comments"):
        write_connection(home, "site", "10.0.0.5:8000", insecure=True)
    assert tomllib.loads((home / "config.toml").read_text())["superlink"] == {
        "default": "site", "local": {"address": ":local:"}, "site": {"address": "10.0.0.5:8000", "insecure": True}}
