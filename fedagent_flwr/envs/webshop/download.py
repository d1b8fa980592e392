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

from pathlib import Path

# The fetcher is shared with ALFWorld's download command; tests import these names from here too.
from fedagent_flwr.cli import program
from fedagent_flwr.fetch import DataFile, download_main, fetch_files
from fedagent_flwr.fetch import DownloadError as DownloadError  # re-exported: tests import it from here

_RAW = "https://raw.githubusercontent.com"
_FEDAGENT = "sunblaze-ucb/FedAgent/a6fdf2c84fd83966388ebcd01866c3eca8cf2d31"


FILES: tuple[DataFile, ...] = (
    DataFile("items_shuffle_1000.json",
             f"{_FEDAGENT}/fedagent/envs/webshop/engine/webshop/data/items_shuffle_1000.json"),
    DataFile("items_ins_v2_1000.json", f"{_FEDAGENT}/fedagent/envs/webshop/engine/webshop/data/items_ins_v2_1000.json",
             "e411cc853a2c56ecf0a148449ca73cbc201b0099d8f64624436d81795219186a"),
    DataFile("lookalike/lookalike_v_color.json",
             f"{_FEDAGENT}/data/env_heterogeneity/lookalike_data/lookalike_v_color.json",
             "467ab7b972c5682537f54a30ae02604ab20761511e4379661f24f5afa9252a82"),
    DataFile("lookalike/lookalike_v_size.json",
             f"{_FEDAGENT}/data/env_heterogeneity/lookalike_data/lookalike_v_size.json",
             "2900f2715310d2904a9881b3cd0fa7fed9fa04d4e9dcb6563b38281458110f0d"),
    DataFile("lookalike/lookalike_v_price_color.json",
             f"{_FEDAGENT}/data/env_heterogeneity/lookalike_data/lookalike_v_price_color.json",
             "0a2033a34f4190d6c9a9d73d2d06a69a2d8be9d1effe3c0cec7fd86a6f6647fc"),
    DataFile("hardness/qwen2.5-1.5b_webshop_trajectories.json",
             f"{_FEDAGENT}/fedagent/data/hardness/qwen2.5-1.5b_webshop_trajectories.json",
             "5b05ffe031d32d8b8ff27e8e99d241721497ff580b832b4ef964e718e221af0b"),
)


def fetch(data_dir: str | Path, base_url: str = _RAW, files: tuple[DataFile, ...] = FILES,
          timeout_s: float = 120.0) -> list[Path]:
    """Download every missing (or wrong-hash) WebShop file into ``data_dir``; return the paths fetched."""
    return fetch_files(data_dir, files, base_url, timeout_s)


def _fetch_summary(data_dir: Path, base_url: str) -> str:
    fetched = fetch(data_dir, base_url)
    return f"{len(fetched)} file(s) fetched; WebShop data ready in {data_dir.resolve()}"


def main(argv: list[str] | None = None) -> int:
    return download_main(argv, prog=program("python -m fedagent_flwr.envs.webshop.download"),
                         description=__doc__.splitlines()[0], base_url=_RAW,
                         base_url_help="a mirror laid out as <owner>/<repo>/<commit>/<path>", download=_fetch_summary)


if __name__ == "__main__":
    raise SystemExit(main())
