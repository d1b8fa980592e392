"""Checkpoint stores: how a reference in a Flower message becomes files on the machine that needs them.

Messages carry references, never weights. A store is the one place that knows where a
reference's files are:

- ``shared-fs`` (the HPC default): server and clients see one filesystem. References are
  absolute paths under the run's root; nothing is copied.
- ``http``: no shared filesystem. The ServerApp serves a small HTTP(S) store
  (:mod:`.http_server`); clients download the global model into a node-local cache and upload
  their checkpoint into a slot the server opened for them (:mod:`.http_client`). References are
  URLs under ``<store url>/runs/<run id>/``; every file is checked against its sha256 on both
  ends and transfers resume where they stopped.
- ``s3``: no shared filesystem, but a bucket every machine reaches (AWS S3 or an S3-compatible
  service): the server uploads global models there and downloads the clients' uploads
  (:mod:`.s3_store`, :mod:`.s3_client`). References are ``s3://`` URLs under
  ``<storage.url>/runs/<run id>/``; credentials come from each machine's own environment.

Each store has a server half (:class:`ServerStore`: share the global model, check a client's
reference and turn it into a local directory under the run root) and a client half
(:class:`ClientStore`: fetch the global model, put a checkpoint). The server half also says what
every instruction must carry for a client to open its half (:meth:`ServerStore.instruction_fields`),
so the ClientApp needs no store settings of its own beyond a working directory.

Trust: the server accepts from a client only a reference inside the client's own slot of the
current round, ``<run root>/round_<r>/client_<c>/`` (shared-fs: where the ClientApp writes its
job; http: the upload slot the server opened for it), with a content hash, so no client can
answer with another client's checkpoint (and be counted twice) or with a global model; a client
accepts only a global model of its current run.
"""

from __future__ import annotations

import ipaddress
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fedagent_flwr.atomic import write_json_atomic
from fedagent_flwr.checkpoint.manifest import MAX_FILES
from fedagent_flwr.checkpoint.receipts import ReceiptCheck
from fedagent_flwr.checkpoint.ref import CheckpointError, CheckpointKind, CheckpointRef, is_sha256, resolve_inside
from fedagent_flwr.schema.run import STORE_KINDS, Storage

PUBLISHED_FILE = "published_models.json"

# Instruction fields (ConfigRecord keys) of the store contract.
KIND_FIELD = "store-kind"
RUN_ROOT_FIELD = "run-root"
URL_FIELD = "store-url"
RUN_FIELD = "store-run"
READ_TOKEN_FIELD = "store-read-token"
UPLOAD_TOKEN_FIELD = "store-upload-token"
CA_FIELD = "store-ca-pem"
ENDPOINT_FIELD = "store-endpoint-url"


@dataclass
class StorageSettings(Storage):
    """The ``storage`` config group (its keys, defaults and bounds: :class:`~fedagent_flwr.schema.run.Storage`)
    with what the store does with them."""

    max_files_per_upload: int = MAX_FILES  # http: files one upload slot holds (not a config key)

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_slot(run_root: str | os.PathLike[str], server_round: int, client: int) -> Path:
    """``<run root>/round_<r>/client_<c>``: everything client ``c`` writes (or uploads) for round ``r``."""
    return Path(run_root) / f"round_{server_round}" / f"client_{client}"


def progress_url(base_url: str, run_key: str, server_round: int, client: int) -> str:
    """Where the http store takes client ``client``'s progress file of ``server_round``."""
    return f"{base_url}/runs/{run_key}/progress/{server_round}/{client}"


def require_hash(ref: CheckpointRef, who: str) -> None:
    """A reference the server did not make must carry the content hash it is checked against."""
    if not is_sha256(ref.sha256):
        raise CheckpointError(f"{who}'s reference {ref.path[:120]!r} carries no sha256 content hash")


def store_ref_parts(path: str, base_url: str, run_key: str, who: str) -> list[str]:
    """The segments after ``<base_url>/runs/<run_key>/`` of a store URL, checked.

    Refuses (CheckpointError naming ``who``) another scheme or host, another run, and any
    segment that is empty, ``.``/``..``, percent-encoded or holds characters outside
    ``[A-Za-z0-9._-]``: a reference can only name what the store itself would name.
    """
    parts = urlsplit(path)
    base = urlsplit(base_url)
    if parts.scheme != base.scheme:
        raise CheckpointError(
            f"{who} reference {path[:120]!r} uses scheme '{parts.scheme or 'none'}'; this run's store is {base_url}"
        )
    if parts.netloc != base.netloc or parts.query or parts.fragment:
        raise CheckpointError(f"{who} reference {path[:120]!r} is not on this run's store {base_url}")
    prefix = base.path.rstrip("/") + "/runs/"
    if not parts.path.startswith(prefix):
        raise CheckpointError(f"{who} reference {path[:120]!r} names no run of the store {base_url}")
    segments = parts.path[len(prefix):].split("/")
    for segment in segments:
        if segment in ("", ".", "..") or not all(ch.isascii() and (ch.isalnum() or ch in "._-") for ch in segment):
            raise CheckpointError(f"{who} reference {path[:120]!r} has a malformed segment {segment[:40]!r}")
    if segments[0] != run_key:
        raise CheckpointError(
            f"{who} reference {path[:120]!r} belongs to run {segments[0]}, not to this run ({run_key})"
        )
    return segments[1:]


# ------------------------------------------------------------------------------------- server half


def own_upload_parts(ref: CheckpointRef, base_url: str, run_key: str, server_round: int, client: int) -> list[str]:
    """The store path segments of client ``client``'s own upload of ``ref.kind`` in ``server_round``
    (``uploads/<round>/<client>/<kind>``), after checking that ``ref`` carries a content hash and
    names exactly that location; CheckpointError naming the client otherwise. A remote store reads
    nothing a client reference names elsewhere."""
    who = f"client {client}"
    require_hash(ref, who)
    expected = ["uploads", str(server_round), str(client), ref.kind]
    if store_ref_parts(ref.path, base_url, run_key, who) != expected:
        raise CheckpointError(
            f"{who} reference {ref.path[:120]!r} does not name its own upload slot of round "
            f"{server_round} ({base_url}/runs/{run_key}/{'/'.join(expected)})"
        )
    return expected


@dataclass(frozen=True)
class Release:
    """What a commit lets a store drop from copies of its own outside the run directory
    (:meth:`ServerStore.release`), in the terms of :mod:`fedagent_flwr.serverapp.retention`."""

    committed_round: int
    client_uploads: bool  # the clients' uploads of rounds up to committed_round may go
    # Per checkpoint kind ("actor", "critic"): the local directories of the global models to keep
    # (the newest aggregated ones; the newest always among them). Every other shared model of that
    # kind may go; a kind absent keeps all its models (none aggregated yet: the one shared is the
    # newest); None keeps every model (storage.keep_last_k=0).
    keep_models: Mapping[str, frozenset[Path]] | None


@dataclass
class Released:
    """What :meth:`ServerStore.release` removed, for the round's summary entry."""

    where: str  # the store's location of this run, for the log
    removed: dict[int, dict[str, int]] = field(default_factory=dict)  # round -> kind -> bytes (retention's kinds)
    objects: dict[int, int] = field(default_factory=dict)  # round -> objects removed
    failure: str = ""  # one line (what failed, what stays, what to do); the run goes on


class ServerStore(ABC):
    """The ServerApp's side of a store (one per run)."""

    kind: str

    def __init__(self, run_root: str | os.PathLike[str]) -> None:
        self.run_root = Path(run_root).resolve()

    @abstractmethod
    def share(self, ref: CheckpointRef) -> CheckpointRef:
        """Make a server-side model readable by this run's clients; return the reference to send."""

    @abstractmethod
    def resolve(self, ref: CheckpointRef, server_round: int, client: int) -> CheckpointRef:
        """Check client ``client``'s reference of ``server_round``; return it as a local directory
        under the run root (the caller opens it, which checks symlinks, layout and hash)."""

    @abstractmethod
    def instruction_fields(self) -> dict[str, Any]:
        """What every instruction carries so that a client can open its half of the store."""

    def upload_grant(self, server_round: int, client: int) -> dict[str, Any]:
        """Extra train-instruction fields allowing ``client`` to put its checkpoint of ``server_round``."""
        return {}

    def receipt_check(self) -> ReceiptCheck | None:
        """What lets the aggregation take a file's digest from the store's receipt instead of hashing
        it (:mod:`.receipts`); None (the default, and shared-fs: the clients write those files
        themselves) hashes every file while reading."""
        return None

    def release(self, plan: Release) -> Released | None:
        """After a commit, remove the store's own copies that ``plan`` no longer needs; never raises
        (a failure is :attr:`Released.failure`). None (the default; shared-fs and http, whose files
        are all in the run directory, which retention cleans itself): the store keeps nothing else."""
        return None

    def release_earlier(self, run_ids: Sequence[int], client_uploads: bool, models: bool) -> Released | None:
        """When a run resumes: remove the copies the store kept for the run's earlier attempts (Flower
        run ids ``run_ids``, as the run's summary records them): their clients' uploads if
        ``client_uploads``, their shared models if ``models``; never raises. None (the default; stores
        keeping nothing outside the run directory): nothing to remove."""
        return None

    def describe(self) -> str:
        return f"{self.kind} store at {self.run_root}"

    def close(self) -> None:  # noqa: B027 -- optional hook, no-op by default
        """Release what the store holds (the http store stops serving)."""

    def __enter__(self) -> ServerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedFsServerStore(ServerStore):
    """References are absolute paths on a filesystem every node mounts at the same place.

    A model outside the run root (the base model) is listed in ``<run root>/published_models.json``
    when shared, so that a client can tell a model of this run from any other directory.
    """

    kind = "shared-fs"

    def share(self, ref: CheckpointRef) -> CheckpointRef:
        try:
            resolve_inside(ref, self.run_root)
            return ref
        except CheckpointError:
            pass
        published = read_published(self.run_root)
        if published.get(ref.path) != ref.sha256:
            write_json_atomic(self.run_root / PUBLISHED_FILE, {**published, ref.path: ref.sha256})
        return ref

    def resolve(self, ref: CheckpointRef, server_round: int, client: int) -> CheckpointRef:
        require_hash(ref, f"client {client}")
        target = resolve_inside(ref, self.run_root)  # scheme, '..' and symlink escapes: a clear message now
        # Not resolved: a slot that is a symlink (to another client's slot) holds nothing of its own.
        slot = client_slot(self.run_root, server_round, client)
        if slot not in target.parents:
            raise CheckpointError(
                f"client {client}'s reference {ref.path[:200]!r} is not in its own slot of round "
                f"{server_round} ({slot}/): a client may answer only with a checkpoint it wrote there"
            )
        return ref

    def instruction_fields(self) -> dict[str, Any]:
        return {KIND_FIELD: self.kind, RUN_ROOT_FIELD: str(self.run_root)}


def read_published(run_root: Path) -> dict[str, str]:
    """``{path: sha256}`` of the models outside ``run_root`` its server shared (shared-fs)."""
    try:
        data = json.loads((run_root / PUBLISHED_FILE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{run_root / PUBLISHED_FILE} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{run_root / PUBLISHED_FILE} is not a JSON object")
    return {str(k): str(v) for k, v in data.items()}


def open_server_store(settings: StorageSettings, run_root: str | os.PathLike[str], run_key: str) -> ServerStore:
    """The run's server store (the http one starts serving before this returns)."""
    if settings.kind == "shared-fs":
        return SharedFsServerStore(run_root)
    if settings.kind == "http":
        from fedagent_flwr.checkpoint.http_server import HttpServerStore

        return HttpServerStore(settings, run_root, run_key)
    if settings.kind == "s3":
        from fedagent_flwr.checkpoint.s3_store import S3ServerStore

        return S3ServerStore(settings, run_root, run_key)
    raise CheckpointError(f"unknown storage kind {settings.kind!r} (expected one of {STORE_KINDS})")


# ------------------------------------------------------------------------------------- client half


class ClientStore(ABC):
    """A ClientApp's side of a store (one per message)."""

    kind: str

    @property
    @abstractmethod
    def run_root(self) -> Path:
        """This node's directory for the run's outputs (trainer jobs, checkpoints, service state)."""

    @abstractmethod
    def fetch(self, ref: CheckpointRef) -> Path:
        """A local directory holding the global model ``ref``; refuses a model of another run."""

    @abstractmethod
    def put(self, directory: str | os.PathLike[str], kind: CheckpointKind, server_round: int,
            client: int) -> CheckpointRef:
        """Make the checkpoint ``directory`` available to the server; return the reference to reply with."""

    # Whether the client's progress file must be sent to the server (http); with a shared
    # filesystem the trainer writes it into the client's slot, where the server reads it.
    forwards_progress = False

    def send_progress(self, data: bytes, server_round: int, client: int) -> None:  # noqa: B027 - optional
        """Put the bytes of the client's progress file into its slot of ``server_round`` on the
        server (:mod:`fedagent_flwr.progress`); a no-op where nothing needs to travel."""


class SharedFsClientStore(ClientStore):
    """The client side of :class:`SharedFsServerStore`: paths are read where they are."""

    kind = "shared-fs"

    def __init__(self, run_root: str) -> None:
        root = Path(run_root)
        if not root.is_absolute() or ".." in root.parts:
            raise CheckpointError(
                f"instruction field '{RUN_ROOT_FIELD}' = {run_root!r} must be an absolute path without '..'"
            )
        self._run_root = root

    @property
    def run_root(self) -> Path:
        return self._run_root

    def fetch(self, ref: CheckpointRef) -> Path:
        try:
            directory = resolve_inside(ref, self._run_root)
        except CheckpointError:
            if "://" in ref.path:
                raise
            if read_published(self._run_root).get(ref.path) != ref.sha256:
                raise CheckpointError(
                    f"global model {ref.path!r} is not a model of this run: it lies outside the run "
                    f"root {self._run_root} and its server did not publish it"
                ) from None
            directory = Path(ref.path)
        if not directory.is_dir():
            raise CheckpointError(f"global model {ref.path} is not a directory on this node")
        return directory

    def put(self, directory: str | os.PathLike[str], kind: CheckpointKind, server_round: int,
            client: int) -> CheckpointRef:
        return CheckpointRef.for_directory(directory, kind)


def open_client_store(config: Mapping[str, Any], run_id: int, work_dir: Callable[[], Path],
                      cache_keep: int = 0) -> ClientStore:
    """The client store an instruction describes (``store-kind`` absent means shared-fs).

    ``work_dir`` is called only by stores that keep files on the node (http, s3), so a shared-fs
    node needs no working-directory setting; ``cache_keep`` bounds the http and s3 stores' node cache
    (:mod:`.node_cache`; 0 keeps every model).
    """
    kind = str(config.get(KIND_FIELD, "shared-fs"))
    if kind == "shared-fs":
        if RUN_ROOT_FIELD not in config:
            raise CheckpointError(f"a shared-fs instruction must carry '{RUN_ROOT_FIELD}'")
        return SharedFsClientStore(str(config[RUN_ROOT_FIELD]))
    if kind == "http":
        from fedagent_flwr.checkpoint.http_client import HttpClientStore

        try:
            run_key, url = str(config[RUN_FIELD]), str(config[URL_FIELD])
            read_token = str(config[READ_TOKEN_FIELD])
        except KeyError as exc:
            raise CheckpointError(f"an http store instruction must carry {exc}") from None
        if run_key != str(run_id):
            raise CheckpointError(f"instruction for run {run_key} reached this node in run {run_id}")
        return HttpClientStore(
            url, run_key, read_token, work_dir(),
            upload_token=str(config.get(UPLOAD_TOKEN_FIELD, "")), ca_pem=str(config.get(CA_FIELD, "")),
            cache_keep=cache_keep,
        )
    if kind == "s3":
        from fedagent_flwr.checkpoint.s3_client import S3ClientStore

        try:
            run_key, url = str(config[RUN_FIELD]), str(config[URL_FIELD])
        except KeyError as exc:
            raise CheckpointError(f"an s3 store instruction must carry {exc}") from None
        if run_key != str(run_id):
            raise CheckpointError(f"instruction for run {run_key} reached this node in run {run_id}")
        return S3ClientStore(url, run_key, work_dir(), endpoint_url=str(config.get(ENDPOINT_FIELD, "")),
                             cache_keep=cache_keep)
    raise CheckpointError(f"instruction names unknown store kind {kind!r} (expected one of {STORE_KINDS})")
