"""Files a SuperLink/SuperNode deployment needs: TLS certificates, node keys, the connection config.

Production sites should use certificates from their own CA; :func:`make_tls_files` writes a
self-signed CA and a server certificate for local testing and small private federations. Node
authentication keys must be elliptic-curve keys in OpenSSH format (Flower loads them with
``load_ssh_private_key``), which :func:`make_node_key` writes.

    python -m fedagent_flwr.deploy tls DIR --host 10.0.0.5 [--host superlink.example.org] [--force]
    python -m fedagent_flwr.deploy node-key DIR/supernode-0 [--force]
    python -m fedagent_flwr.deploy connection FLWR_HOME NAME ADDRESS --root-certificates DIR/ca.crt
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
import tempfile
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from flwr.cli.constant import DEFAULT_FLOWER_CONFIG_TOML  # what Flower writes when it finds no config.toml

from fedagent_flwr.cli import program
from fedagent_flwr.deploy_checks import (
    MAX_DAYS,
    check_address,
    check_days,
    check_folder,
    check_given,
    check_hosts,
    check_root_certificates,
    os_error_message,
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for ``flower-superlink --ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """A SuperNode's key pair: ``--auth-supernode-private-key`` and the ``flwr supernode register`` file."""

    private_key: Path
    public_key: Path


def _make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return the ones this call created, deepest first,
    so a write that fails afterwards can remove them (:func:`_remove_folders`) and leave no trace."""
    missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_folders(created: list[Path]) -> None:
    """Remove the folders :func:`_make_folders` created, deepest first, where they are still empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile) or gone: leave it
            pass


def _write_new(files: list[tuple[Path, bytes, int]], force: bool, consequence: str, elsewhere: str) -> None:
    """Write every ``(path, data, mode)`` of a set; without ``force``, all of them or none.

    Any path that exists already (a symlink included, even a dangling one) refuses the whole set
    before anything is written, unless ``force`` (then a failure partway, e.g. a rename the file
    system refuses, can leave the set partly replaced: the files already renamed stay). Each file is written
    to a private temporary name in its own directory, flushed, given its mode and renamed into place,
    so a link at the target is replaced, never written through, and no half-written file is ever
    seen under the real name. A folder at a target, or a file where a parent folder should be, is
    refused first (:class:`ValueError`), also with ``force``: no rename could put a file there.
    """
    for path, _, _ in files:
        check_folder(path.parent, f"choose another {elsewhere}")
        if os.path.isdir(path) and not os.path.islink(path):  # a link to a folder is replaced like any link
            raise ValueError(f"{path} is a folder; nothing was written. Move it away, or choose another {elsewhere}")
    existing = [path for path, _, _ in files if os.path.lexists(path)]
    if existing and not force:
        names = ", ".join(str(path) for path in existing)
        raise FileExistsError(f"{names} already exist{'s' if len(existing) == 1 else ''}; nothing was written. "
                              f"Pass --force to replace {'it' if len(existing) == 1 else 'them'} ({consequence}), "
                              f"or choose another {elsewhere}")
    temps: list[tuple[str, Path]] = []
    placed: list[Path] = []
    created: list[Path] = []
    try:
        for path, data, mode in files:
            created += _make_folders(path.parent)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            temps.append((tmp, path))
            with os.fdopen(fd, "wb") as handle:
                os.fchmod(handle.fileno(), mode)  # the mode asked for, whatever the umask
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        for tmp, path in temps:
            if force:
                os.replace(tmp, path)
            else:
                # a hard link never replaces an existing name: a file that appeared since the check
                # above is refused too, not overwritten
                try:
                    os.link(tmp, path)
                except FileExistsError:  # its own message would name the temporary file
                    raise FileExistsError(f"{path} appeared while writing; nothing was replaced") from None
                except OSError:  # a file system without hard links: check again, then rename
                    if os.path.lexists(path):
                        raise FileExistsError(f"{path} appeared while writing; nothing was replaced") from None
                    os.rename(tmp, path)
                else:
                    os.unlink(tmp)
            placed.append(path)
    except BaseException:
        for tmp, _ in temps:
            Path(tmp).unlink(missing_ok=True)
        if not force:  # only files this call created; nothing of the user's is touched
            for path in placed:
                path.unlink(missing_ok=True)
        _remove_folders(created)  # kept only where a file of the set was placed in them
        raise


def _san_entry(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_tls_files(directory: str | os.PathLike[str], hosts: tuple[str, ...] | list[str] = ("127.0.0.1",),
                   days: int = 365, force: bool = False) -> TlsFiles:
    """Write ``ca.crt``, ``server.pem`` and ``server.key`` into ``directory``.

    ``hosts`` are the addresses SuperNodes and ``flwr`` use to reach the SuperLink (IP addresses
    or DNS names); each becomes a subjectAltName of the server certificate, which TLS checks.
    The CA's private key is not kept: nothing else can be signed with it later, so files that
    exist already are never replaced (:class:`FileExistsError`, nothing written) unless ``force``.
    ``days`` (1 to :data:`~fedagent_flwr.deploy_checks.MAX_DAYS`) and ``hosts`` are checked before
    any key is made (:class:`ValueError`).
    """
    check_given(directory, "DIRECTORY")
    check_days(days)
    check_hosts(hosts)
    out = Path(directory)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedagent-flwr test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP384R1())
    # X.509 caps a common name at 64 characters while a DNS name may have 253; TLS checks the
    # subjectAltNames, so a longer first host only needs a stand-in here
    common_name = hosts[0] if len(hosts[0]) <= 64 else "fedagent-flwr SuperLink"
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san_entry(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    pem = serialization.Encoding.PEM
    files = TlsFiles(ca_cert=out / "ca.crt", server_cert=out / "server.pem", server_key=out / "server.key")
    _write_new([
        (files.ca_cert, ca_cert.public_bytes(pem), 0o644),
        (files.server_cert, server_cert.public_bytes(pem), 0o644),
        (files.server_key, server_key.private_bytes(
            pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()), 0o600),
    ], force, "a new CA: the old one's key is not kept, so every SuperNode and flwr user needs the new ca.crt",
       "directory")
    return files


def make_node_key(path: str | os.PathLike[str], force: bool = False) -> NodeKey:
    """Write an ECDSA (P-384) key pair in OpenSSH format: ``path`` and ``path.pub``.

    The same files ``ssh-keygen -t ecdsa -b 384 -N "" -f path`` would write. If either exists
    already, nothing is written (:class:`FileExistsError`) unless ``force``. An empty path, or one
    that names no file (``.``, ``..``, a folder), is refused (:class:`ValueError`).
    """
    check_given(path, "PATH")
    private = Path(path)
    if private.name in ("", ".", ".."):  # Path("..").name is "..": there is no file name to add ".pub" to
        raise ValueError(f"PATH {os.fspath(path)!r} names no file: give the private key's file path, "
                         "e.g. keys/supernode-0 (keys/supernode-0.pub is written next to it)")
    key = ec.generate_private_key(ec.SECP384R1())
    private_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                      serialization.NoEncryption())
    public_bytes = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                 serialization.PublicFormat.OpenSSH)
    pair = NodeKey(private_key=private, public_key=private.with_name(private.name + ".pub"))
    _write_new([(pair.private_key, private_bytes, 0o600), (pair.public_key, public_bytes + b"\n", 0o644)],
               force, "a replaced key cannot be recovered", "path")
    return pair


def _connection_table(name: str, address: str, root_certificates: str | os.PathLike[str] | None,
                      insecure: bool) -> tomlkit.items.Table:
    """The ``[superlink.<name>]`` table of one connection (tomlkit quotes and escapes the values)."""
    if not name or not all(ch.isalnum() or ch in "-_" for ch in name):
        raise ValueError(f"connection name {name!r} must be letters, digits, '-' or '_'")
    if insecure == (root_certificates is not None):
        raise ValueError("give either root_certificates (TLS) or insecure=True, not both or neither")
    table = tomlkit.table()
    table.add("address", address)
    if insecure:
        table.add("insecure", True)
    else:
        table.add("root-certificates", str(Path(root_certificates).resolve()))  # type: ignore[arg-type]
    return table


def connection_toml(name: str, address: str, root_certificates: str | os.PathLike[str] | None = None,
                    insecure: bool = False, default: bool = True) -> str:
    """A Flower configuration (``$FLWR_HOME/config.toml``) with one SuperLink connection.

    TLS is the default: give ``root_certificates`` (the CA that signed the SuperLink's
    certificate), or ``insecure=True`` for local testing only.
    """
    connections = tomlkit.table(is_super_table=not default)
    if default:
        connections.add("default", name)
    connections.add(name, _connection_table(name, address, root_certificates, insecure))
    return tomlkit.dumps({"superlink": connections})


def _config_target(path: Path) -> Path:
    """The file to rewrite for ``path``: itself, or what it links to (a config kept elsewhere, in
    dotfiles, stays linked). A link to nothing, or a loop of links, is refused by name: following
    it would create folders wherever it points."""
    if not path.is_symlink():
        return path
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop, on Python 3.11
        raise ValueError(f"{path} is a link to {os.readlink(path)}, which does not exist or loops ({exc}); "
                         "fix or remove the link, then run this again") from exc


def _moved_comments(table: tomlkit.items.Table) -> list[tuple[None, tomlkit.items.Item]]:
    """Take the comments (and what follows them) off the end of ``table``: tomlkit keeps the
    comment lines above a table's header as the tail of the table before it, so they must move
    with that header, not stay with a table that is replaced or that a new one follows."""
    body = table.value.body
    start = len(body)
    while start > 0 and body[start - 1][0] is None:
        start -= 1
    while start < len(body) and isinstance(body[start][1], tomlkit.items.Whitespace):
        start += 1  # the blank lines that end the table stay with it
    moved = body[start:]
    del body[start:]
    return moved  # type: ignore[return-value]


def _with_layout(original: str, name: str, table: tomlkit.items.Table, make_default: bool) -> str | None:
    """``original`` with the connection set and the rest of the text as it was (comments, order,
    blank lines); None where tomlkit cannot edit this file's shape (``superlink`` as an inline table)."""
    doc = tomlkit.parse(original)
    connections = doc.setdefault("superlink", tomlkit.table(is_super_table=True))
    if not isinstance(connections, tomlkit.items.Table):
        return None
    old = connections.get(name)
    if isinstance(old, tomlkit.items.Table):
        tail = _moved_comments(old)  # the comments above the header that follows it
    else:
        children = [item for _, item in connections.value.body if isinstance(item, tomlkit.items.Table)]
        tail = _moved_comments(children[-1]) if children else []
        for _ in range(2):  # a blank line before the new header, also after a file's last line without one
            if children and not children[-1].as_string().endswith("\n\n"):
                children[-1].add(tomlkit.nl())
    table.add(tomlkit.nl())  # the blank line before what follows (kept off the file's end below)
    for key, item in tail:
        table.value.body.append((key, item))
    connections[name] = table
    if make_default:
        connections["default"] = name
    return tomlkit.dumps(doc).rstrip("\n") + "\n"  # the new table's blank line is not left at the end


def write_connection(flwr_home: str | os.PathLike[str], name: str, address: str,
                     root_certificates: str | os.PathLike[str] | None = None, insecure: bool = False,
                     make_default: bool = True, force: bool = False) -> Path:
    """Add this connection to ``flwr_home/config.toml`` (made the default); return its path.

    The file is merged, never replaced: Flower's own connections (``local``, ``supergrid``) and the
    user's stay, so ``flwr run .`` keeps working, and so do the file's comments and layout (a
    ``config.toml`` that links elsewhere stays a link: the file it points to is edited). A missing
    file starts from Flower's default configuration, as Flower itself would create it. A connection
    of the same name is an error unless ``force`` (then it is replaced). The edit is checked against
    the file's values: where it would not give exactly them plus the connection (a shape tomlkit
    cannot edit in place, e.g. ``superlink`` as dotted keys or an inline table), the file is written
    from its values instead, without its comments, with a warning. The file is written to a
    temporary name and renamed. The address (``HOST:PORT``), the root certificates (an existing
    PEM file), ``flwr_home`` (a folder or none yet) and its ``config.toml`` (a file or none yet) are
    checked before anything is written (:class:`ValueError`).
    """
    check_given(flwr_home, "FLWR_HOME")
    check_folder(Path(flwr_home), "give FLWR_HOME as a folder (it is created if missing)")
    check_address(address)
    if root_certificates is not None and not insecure:
        check_root_certificates(root_certificates)
    path = Path(flwr_home) / "config.toml"
    target = _config_target(path)
    if target.exists() and not target.is_file():
        kind = "a folder" if target.is_dir() else "not a regular file"
        raise ValueError(f"{target} is {kind}, not a Flower config; nothing was written. Move it away, "
                         "or give another FLWR_HOME")
    try:
        original = target.read_text(encoding="utf-8") if target.exists() else DEFAULT_FLOWER_CONFIG_TOML
    except UnicodeDecodeError as exc:
        raise ValueError(f"{target} is not UTF-8 text ({exc.reason}); fix or move it away, "
                         "then run this again") from None
    try:
        config = tomllib.loads(original)  # the values, by the standard library's strict parser
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{target} is not valid TOML ({exc}); fix or move it away, then run this again") from exc
    connections = config.setdefault("superlink", {})
    if not isinstance(connections, dict):
        raise ValueError(f"{target}: 'superlink' is not a table; fix the file, then run this again")
    if name == "default":
        raise ValueError("a connection cannot be named 'default' (Flower's [superlink] default key)")
    if name in connections and not force:
        raise ValueError(f"{target} already has a connection named {name!r}; choose another name, "
                         "or pass --force to replace it")
    table = _connection_table(name, address, root_certificates, insecure)
    connections[name] = table.unwrap()
    if make_default:
        connections["default"] = name
    try:
        text = _with_layout(original, name, table, make_default)
    except (tomlkit.exceptions.TOMLKitError, ValueError, TypeError, KeyError):
        text = None  # a shape tomlkit refuses to edit: the values are written, as below
    if text is None or tomllib.loads(text) != config:
        warnings.warn(f"{target}: its layout could not be kept with the new connection; it is written "
                      "from its values, without its comments", stacklevel=2)
        text = tomlkit.dumps(config)
    # a private temporary name next to it (never a fixed name a link could redirect), the file's
    # own mode kept (a user's 0600 stays 0600), flushed to disk before it replaces the original
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    created = _make_folders(target.parent)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        _remove_folders(created)  # a failed write leaves no empty FLWR_HOME behind
        raise
    return path


def _one_line(exc: ValueError | OSError) -> str:
    """The message a refusal prints: an OSError's file and reason, or the check's own sentence."""
    return os_error_message(exc) if isinstance(exc, OSError) else str(exc)


def main(argv: list[str] | None = None) -> int:
    """``fedagent deploy tls|node-key|connection``: bad input is one line on stderr and exit 2."""
    parser = argparse.ArgumentParser(prog=program("python -m fedagent_flwr.deploy"),
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tls = sub.add_parser("tls", help="self-signed CA + SuperLink server certificate")
    tls.add_argument("directory")
    tls.add_argument("--host", action="append", required=True,
                     help="address SuperNodes use to reach the SuperLink (repeat for several)")
    tls.add_argument("--days", type=int, default=365, help=f"certificate lifetime in days, 1 to {MAX_DAYS}")
    tls.add_argument("--force", action="store_true", help="replace ca.crt, server.pem, server.key if they exist")
    key = sub.add_parser("node-key", help="ECDSA key pair in OpenSSH format for one SuperNode")
    key.add_argument("path")
    key.add_argument("--force", action="store_true", help="replace PATH and PATH.pub if they exist")
    conn = sub.add_parser("connection", help="add a connection to FLWR_HOME/config.toml (others are kept)")
    conn.add_argument("flwr_home")
    conn.add_argument("name")
    conn.add_argument("address")
    group = conn.add_mutually_exclusive_group(required=True)
    group.add_argument("--root-certificates")
    group.add_argument("--insecure", action="store_true", help="no TLS: local testing only")
    conn.add_argument("--force", action="store_true", help="replace an existing connection of this name")
    conn.add_argument("--no-default", action="store_true", help="keep the current default connection")
    args = parser.parse_args(argv)
    if args.command == "tls":
        try:
            files = make_tls_files(args.directory, args.host, args.days, force=args.force)
        except (ValueError, OSError) as exc:  # bad input, a file in the way, or a folder it cannot write
            print(f"deploy tls: {_one_line(exc)}", file=sys.stderr)
            return 2
        print(f"CA certificate:     {files.ca_cert}  (give to every SuperNode and flwr user)")
        print(f"server certificate: {files.server_cert}")
        print(f"server key:         {files.server_key}  (SuperLink only)")
    elif args.command == "node-key":
        try:
            pair = make_node_key(args.path, force=args.force)
        except (ValueError, OSError) as exc:
            print(f"deploy node-key: {_one_line(exc)}", file=sys.stderr)
            return 2
        print(f"private key: {pair.private_key}  (this SuperNode only)")
        print(f"public key:  {pair.public_key}  (flwr supernode register)")
    else:
        try:
            path = write_connection(args.flwr_home, args.name, args.address, args.root_certificates, args.insecure,
                                    make_default=not args.no_default, force=args.force)
        except (ValueError, OSError) as exc:
            print(f"deploy connection: {_one_line(exc)}", file=sys.stderr)
            return 2
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
