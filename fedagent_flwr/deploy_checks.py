"""Checks of what ``fedagent deploy`` is given, made before anything is generated or written.

Each check raises :class:`ValueError` with one sentence that names the culprit (the flag, the
path, the value) and says what to give instead, so the command can print it as its one line and
exit 2. Nothing here writes: a refused call leaves every file as it was.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509

#: The longest certificate lifetime ``deploy tls`` writes. The CA's key is thrown away once the
#: files are written, so nothing can revoke or re-sign them: the lifetime is the only limit on how
#: long a copied server key stays usable. Ten years outlasts any test or private federation, and
#: stays far below what ``datetime`` (year 9999) and X.509 can represent.
MAX_DAYS = 3650

#: One DNS label (RFC 1123, plus '_', which container and cluster host names use).
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def check_given(path: str | os.PathLike[str], name: str) -> None:
    """Refuse an empty path argument: ``Path("")`` is the current folder, so files would land there."""
    if not os.fspath(path):
        raise ValueError(f"{name} is empty: give a path")


def check_days(days: int) -> None:
    """Refuse a certificate lifetime outside 1..MAX_DAYS: 0 days writes an already expired
    certificate, a negative count one that ends before it starts, a huge one overflows dates."""
    if not 1 <= days <= MAX_DAYS:
        raise ValueError(f"--days {days} is out of range: give a number of days from 1 to {MAX_DAYS} "
                         "(the certificates' lifetime)")


def _is_dns_name(host: str) -> bool:
    """Whether ``host`` is a DNS name of ASCII labels (a trailing dot allowed), at most 253 long."""
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def check_hosts(hosts: tuple[str, ...] | list[str]) -> None:
    """Refuse a ``--host`` that is no IP address or DNS name: TLS compares the address a client
    dials with these names, so a host with a port, a URL or a typo would only fail at connect time."""
    if not hosts:
        raise ValueError("the server certificate needs at least one --host (IP address or DNS name)")
    for host in hosts:
        if not host:
            raise ValueError("--host is empty: give the IP address or DNS name SuperNodes dial "
                             "(e.g. --host 10.0.0.5)")
        try:
            ipaddress.ip_address(host)
            continue
        except ValueError:
            pass
        if not _is_dns_name(host):
            raise ValueError(f"--host {host!r} is not an IP address or DNS name: give the address SuperNodes "
                             "dial, without a port or scheme (e.g. --host 10.0.0.5 --host superlink.example.org)")


def check_address(address: str) -> None:
    """Refuse a connection ``ADDRESS`` that is not ``HOST:PORT`` with a port in 1..65535 (an IPv6
    host in brackets): Flower would store anything and fail only when ``flwr`` dials it."""
    hint = "give HOST:PORT, e.g. 10.0.0.5:9093, superlink.example.org:9093 or [::1]:9093"
    if "://" in address:  # a URL: flwr dials HOST:PORT and adds the scheme itself
        raise ValueError(f"ADDRESS {address!r} has a scheme: {hint}")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"ADDRESS {address!r} has no port from 1 to 65535: {hint}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return
        except ValueError:
            pass
    elif ":" in host:
        raise ValueError(f"ADDRESS {address!r}: an IPv6 host must be in brackets: {hint}")
    else:
        try:
            ipaddress.IPv4Address(host)
            return
        except ValueError:
            if _is_dns_name(host):
                return
    raise ValueError(f"ADDRESS {address!r} does not start with an IP address or DNS name: {hint}")


def check_root_certificates(path: str | os.PathLike[str]) -> None:
    """Refuse a ``--root-certificates`` that is missing, not a file, or holds no PEM certificate:
    the connection would be written, and ``flwr`` would fail on it at every later command."""
    cert = Path(path)
    what = "give the CA certificate the SuperLink's certificate chains to (ca.crt from `deploy tls`)"
    if not cert.exists():
        raise ValueError(f"--root-certificates {cert} does not exist: {what}")
    if not cert.is_file():
        raise ValueError(f"--root-certificates {cert} is {'a folder' if cert.is_dir() else 'not a file'}: {what}")
    try:
        x509.load_pem_x509_certificates(cert.read_bytes())
    except ValueError:
        raise ValueError(f"--root-certificates {cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----): "
                         f"{what}") from None


def check_folder(folder: Path, what: str) -> None:
    """Refuse ``folder`` where it, or the nearest of its parents that exists, is not a folder (a
    file in the way), before anything is written: ``mkdir`` would fail only halfway through.
    ``what`` says what to give instead."""
    for candidate in (folder, *folder.parents):
        if os.path.lexists(candidate):
            if not candidate.is_dir():  # a link to a folder is a folder
                where = "" if candidate == folder else f", so {folder} cannot be made"
                raise ValueError(f"{candidate} is not a folder{where}: {what}")
            return


def os_error_message(exc: OSError) -> str:
    """One line for an :class:`OSError` (permission denied, disk full): its own sentence where it
    was raised with one, else the file it names and why, and what to check."""
    if exc.filename is None:
        return str(exc)
    return f"cannot use {exc.filename}: {exc.strerror}; check the path and its permissions, or choose another"
