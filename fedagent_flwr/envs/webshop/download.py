"""Fetch the WebShop data files for users with network access.

    python -m fedagent_flwr.envs.webshop.download DATA_DIR [--base-url URL]

The files come from pinned commits of their public repositories (WebShop's 1,000-product
catalogue and attribute file as FedAgent vendors them, FedAgent's look-alike products and
hardness labels). Each download goes to a temporary name and is renamed when complete and, where
the content is pinned, its sha256 checked; files already present with the right hash are kept, so
re-running after an interruption fetches only what is missing. Point the environment at the
folder with ``env.data_dir=DATA_DIR`` or ``FEDAGENT_WEBSHOP_DATA``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

_RAW = "https://raw.githubusercontent.com"
_FEDAGENT = "sunblaze-ucb/FedAgent/a6fdf2c84fd83966388ebcd01866c3eca8cf2d31"


@dataclass(frozen=True)
class DataFile:
    """One file: where it goes under the data dir, where it comes from, its sha256 if pinned."""

    name: str
    source: str  # "<owner>/<repo>/<commit>/<path>"
    sha256: str = ""


FILES: tuple[DataFile, ...] = (
    DataFile("items_shuffle_1000.json", f"{_FEDAGENT}/fedagent/envs/webshop/engine/webshop/data/items_shuffle_1000.json"),
    DataFile("items_ins_v2_1000.json", f"{_FEDAGENT}/fedagent/envs/webshop/engine/webshop/data/items_ins_v2_1000.json",
             "e411cc853a2c56ecf0a148449ca73cbc201b0099d8f64624436d81795219186a"),
    DataFile("lookalike/lookalike_v_color.json", f"{_FEDAGENT}/data/env_heterogeneity/lookalike_data/lookalike_v_color.json",
             "467ab7b972c5682537f54a30ae02604ab20761511e4379661f24f5afa9252a82"),
    DataFile("lookalike/lookalike_v_size.json", f"{_FEDAGENT}/data/env_heterogeneity/lookalike_data/lookalike_v_size.json",
             "2900f2715310d2904a9881b3cd0fa7fed9fa04d4e9dcb6563b38281458110f0d"),
    DataFile("lookalike/lookalike_v_price_color.json",
             f"{_FEDAGENT}/data/env_heterogeneity/lookalike_data/lookalike_v_price_color.json",
             "0a2033a34f4190d6c9a9d73d2d06a69a2d8be9d1effe3c0cec7fd86a6f6647fc"),
    DataFile("hardness/qwen2.5-1.5b_webshop_trajectories.json",
             f"{_FEDAGENT}/fedagent/data/hardness/qwen2.5-1.5b_webshop_trajectories.json",
             "5b05ffe031d32d8b8ff27e8e99d241721497ff580b832b4ef964e718e221af0b"),
)


class DownloadError(RuntimeError):
    """A file could not be fetched or did not match its pinned hash."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fetch(data_dir: str | os.PathLike[str], base_url: str = _RAW, files: tuple[DataFile, ...] = FILES,
          timeout_s: float = 120.0) -> list[Path]:
    """Download every missing (or wrong-hash) file into ``data_dir``; return the paths fetched."""
    root = Path(data_dir)
    fetched = []
    with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
        for item in files:
            target = root / item.name
            if target.exists() and (not item.sha256 or _sha256(target) == item.sha256):
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
            if item.sha256 and (actual := _sha256(partial)) != item.sha256:
                partial.unlink(missing_ok=True)
                raise DownloadError(f"{item.name} from {url} has sha256 {actual}, expected {item.sha256}")
            os.replace(partial, target)
            fetched.append(target)
    return fetched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedagent_flwr.envs.webshop.download",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--base-url", default=_RAW, help="a mirror laid out as <owner>/<repo>/<commit>/<path>")
    args = parser.parse_args(argv)
    try:
        fetched = fetch(args.data_dir, args.base_url)
    except DownloadError as exc:
        print(f"download: error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(fetched)} file(s) fetched; WebShop data ready in {args.data_dir.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
