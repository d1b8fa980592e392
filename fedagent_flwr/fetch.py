"""Fetch pinned data files over HTTP(S): resumable by file, hash-checked, never half-written.

Shared by the environments' download commands (WebShop, ALFWorld), with their command line. A file
goes to a temporary name and is renamed when complete; a file already present (with the right hash,
where one is pinned) is kept, so re-running after an interruption fetches only what is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from fedagent_flwr.checkpoint.manifest import file_sha256


@dataclass(frozen=True)
class DataFile:
    """One file: where it goes under the data dir, where it comes from, its sha256 if pinned."""

    name: str
    source: str  # "<owner>/<repo>/<commit>/<path>"
    sha256: str = ""

class DownloadError(RuntimeError):
    """A file could not be fetched or did not match its pinned hash."""


def fetch_files(data_dir: str | os.PathLike[str], files: Sequence[DataFile], base_url: str,
          timeout_s: float = 120.0) -> list[Path]:
    """Download every missing (or wrong-hash) file into ``data_dir``; return the paths fetched."""
    root = Path(data_dir)
    fetched = []
    with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
        for item in files:
            target = root / item.name
            if target.exists() and (not item.sha256 or file_sha256(target) == item.sha256):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.part")
            url = f"{base_url.rstrip('/')}/{item.source}"
            print(f"fetching {item.name} from {url}", file=sys.stderr, flush=True)
            try:
                with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise DownloadError(f"{url} answered HTTP {response.status_code}")
                    with open(partial, "wb") as handle:
                        for chunk in response.iter_bytes(1 << 20):
                            handle.write(chunk)
            except httpx.HTTPError as exc:
                partial.unlink(missing_ok=True)
                raise DownloadError(f"cannot fetch {url}: {exc} (no network? copy the files by hand)") from None
            if item.sha256 and (actual := file_sha256(partial)) != item.sha256:
                partial.unlink(missing_ok=True)
                raise DownloadError(f"{item.name} from {url} has sha256 {actual}, expected {item.sha256}")
            os.replace(partial, target)
            fetched.append(target)
    return fetched


def download_main(argv: list[str] | None, *, prog: str, description: str, base_url: str, base_url_help: str,
                  download: Callable[[Path, str], str]) -> int:
    """An environment's download command, ``DATA_DIR [--base-url URL]``; the exit status.

    ``download(data_dir, base_url)`` fetches and returns what to print when done; a
    :class:`DownloadError` becomes one line ``download: error: ...`` on stderr and exit status 1.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--base-url", default=base_url, help=base_url_help)
    args = parser.parse_args(argv)
    try:
        summary = download(args.data_dir, args.base_url)
    except DownloadError as exc:
        print(f"download: error: {exc}", file=sys.stderr)
        return 1
    print(summary)
    return 0
