"""A real Flower deployment on loopback: one SuperLink and SuperNodes, TLS and node authentication.

Everything lives in one temporary directory: the certificates and node keys (generated with
``fedagent_flwr.deploy``), the SuperLink's working directory and Flower home (which the ``flwr``
CLI shares, as an operator's machine would), and one working directory and Flower home per
SuperNode, as if each ran on a machine of its own (with the http checkpoint store a SuperNode's
files go to its own ``work`` directory: node config ``work-dir``). Every process is started in a session of
its own and stopped by process group at the end; :meth:`Deployment.leftovers` lists any process
still running inside the directory.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fedagent_flwr.deploy import NodeKey, TlsFiles, make_node_key, make_tls_files, write_connection
from fedagent_flwr.launch import stop_superlink_tree
from testkit.flower_harness import BIN, app_dir, flower_env, free_port, wait_healthy

CONNECTION = "tls-deploy"


@dataclass
class SuperNode:
    """A running ``flower-supernode`` and where its output goes."""

    partition_id: int
    workdir: Path
    log_file: Path
    process: subprocess.Popen[bytes]

    @property
    def store_dir(self) -> Path:
        """The node's own directory for runs without a shared filesystem (node config ``work-dir``)."""
        return self.workdir / "work"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""


@dataclass
class Deployment:
    """A SuperLink with TLS and SuperNode authentication, and the SuperNodes started against it."""

    root: Path
    port: int
    tls: TlsFiles
    env: dict[str, str]
    superlink: subprocess.Popen[bytes]
    superlink_log: Path
    supernodes: list[SuperNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def flwr(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A ``flwr`` CLI command with the operator's Flower home (the TLS connection)."""
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=self.root / "superlink",
                              text=True, capture_output=True, timeout=timeout)

    def new_node_key(self, name: str) -> NodeKey:
        return make_node_key(self.root / "keys" / name)

    def register(self, key: NodeKey) -> str:
        """``flwr supernode register <public key> <connection>``; returns its output."""
        proc = self.flwr("supernode", "register", str(key.public_key), CONNECTION)
        output = proc.stdout + proc.stderr
        if proc.returncode != 0 or "registered successfully" not in output:
            raise RuntimeError(f"flwr supernode register failed ({proc.returncode}):\n{output}")
        return output

    def start_supernode(self, partition_id: int, num_partitions: int, key: NodeKey,
                        name: str | None = None, extra_node_config: str = "") -> SuperNode:
        """Start ``flower-supernode`` in a working directory (and Flower home) of its own
        (``extra_node_config``: more ``key=value`` pairs for its ``--node-config``)."""
        name = name or f"supernode-{partition_id}"
        workdir = self.root / name
        node_config = f'partition-id={partition_id} num-partitions={num_partitions} work-dir="{workdir / "work"}"'
        node_config = f"{node_config} {extra_node_config}".strip()
        home = workdir / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        env = dict(self.env, FLWR_HOME=str(home))
        log_file = workdir / "supernode.log"
        with log_file.open("wb") as log:
            process = subprocess.Popen(
                [str(BIN / "flower-supernode"),
                 "--root-certificates", str(self.tls.ca_cert),
                 "--superlink", self.address,
                 "--auth-supernode-private-key", str(key.private_key),
                 "--node-config", node_config,
                 "--host", "127.0.0.1", "--port", str(free_port())],
                cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        node = SuperNode(partition_id=partition_id, workdir=workdir, log_file=log_file, process=process)
        self.supernodes.append(node)
        return node

    def run(self, overrides: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
        """``flwr run <app> <connection> --stream`` (the repository's app, :func:`app_dir`) with the
        given Hydra overrides."""
        return self.flwr("run", str(app_dir()), CONNECTION, "--stream",
                         "--run-config", f'overrides="{overrides}"', timeout=timeout)

    def logs(self) -> str:
        """The SuperLink's and every SuperNode's log, for assertion messages."""
        parts = [f"--- superlink ---\n{self.superlink_log.read_text(errors='replace')[-4000:]}"
                 if self.superlink_log.exists() else "--- superlink: no log ---"]
        parts += [f"--- {n.workdir.name} ---\n{n.log()[-4000:]}" for n in self.supernodes]
        return "\n".join(parts)

    def leftovers(self) -> list[int]:
        """PIDs of processes whose working directory lies inside this deployment's directory."""
        root = str(self.root.resolve())
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if cwd == root or cwd.startswith(root + os.sep):
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Stop the SuperNodes, then the SuperLink, each with its SuperExec and app processes."""
        # In parallel: each group gets a grace period before SIGKILL.
        with ThreadPoolExecutor(max_workers=max(1, len(self.supernodes))) as pool:
            list(pool.map(lambda node: _stop_tree(node.process), self.supernodes))
        _stop_tree(self.superlink)


def _stop_tree(process: subprocess.Popen[bytes]) -> None:
    """Stop a process's tree by group, reaping it meanwhile: an unreaped zombie leader would keep
    its group alive, and the stop would wait out the whole grace period before SIGKILL."""
    reaper = threading.Thread(target=process.wait, daemon=True)
    reaper.start()
    stop_superlink_tree(process.pid)
    reaper.join(timeout=30)
    process.wait(timeout=30)


def _wait_healthy(process: subprocess.Popen[bytes], port: int, ca_cert: Path, log_file: Path) -> None:
    wait_healthy(process, f"https://127.0.0.1:{port}/health", log_file,
                 verify=ssl.create_default_context(cafile=str(ca_cert)))


@contextmanager
def tls_deployment(root: Path, num_supernodes: int = 2,
                   extra_node_config: dict[int, str] | None = None) -> Iterator[Deployment]:
    """A SuperLink with TLS + SuperNode auth and ``num_supernodes`` registered SuperNodes.

    The SuperNodes serve partitions ``0..num_supernodes-1`` of ``num_supernodes``;
    ``extra_node_config`` adds node config pairs by partition (``{1: "cache-keep=1"}``).
    """
    tls = make_tls_files(root / "tls", hosts=("127.0.0.1",))
    link_dir = root / "superlink"
    home = link_dir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    write_connection(home, CONNECTION, f"127.0.0.1:{port}", root_certificates=tls.ca_cert)
    env = flower_env(home)
    superlink_log = link_dir / "superlink.log"
    superlink = subprocess.Popen(
        [str(BIN / "flower-superlink"),
         "--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
         "--ssl-keyfile", str(tls.server_key), "--enable-supernode-auth",
         "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation", "--log-file", str(superlink_log)],
        cwd=link_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deployment = Deployment(root=root, port=port, tls=tls, env=env, superlink=superlink,
                            superlink_log=superlink_log)
    try:
        _wait_healthy(superlink, port, tls.ca_cert, superlink_log)
        for i in range(num_supernodes):
            key = deployment.new_node_key(f"supernode-{i}")
            deployment.register(key)
            deployment.start_supernode(i, num_supernodes, key,
                                       extra_node_config=(extra_node_config or {}).get(i, ""))
        yield deployment
    finally:
        deployment.stop()
