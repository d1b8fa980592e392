"""Fetch the official ALFWorld game data for users with network access.

    python -m fedagent_flwr.envs.alfworld.download DATA_DIR [--base-url URL]

Downloads the three text-engine archives of ALFWorld's GitHub releases that ``alfworld-download``
0.4.2 fetches (``json_2.1.1_json.zip``: traj_data.json; ``json_2.1.1_pddl.zip``: initial_state.pddl;
``json_2.1.2_tw-pddl.zip``: game.tw-pddl) and unpacks them into ``DATA_DIR/json_2.1.1/`` (the
standard layout). Archives are fetched to temporary names and renamed when complete, and each one
is unpacked through a temporary directory whose files are moved into place, with a marker written
last, so an interrupted run resumes where it stopped. Point the environment at the folder with
``env.data_dir=DATA_DIR`` or ``$ALFWORLD_DATA``. The MaskRCNN weights and checkpoints that
``alfworld-download`` also fetches are for the visual engine and not needed.

The releases publish no checksums, so the archives are not hash-pinned; the summary printed at the
end compares the playable games per split with the official counts (3,553 / 140 / 134).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from fedagent_flwr.cli import program
from fedagent_flwr.envs.alfworld.data import (
    DATA_VERSION_DIR,
    OFFICIAL_SPLIT_SIZES,
    SPLITS,
    AlfWorldDataError,
    load_games,
)
from fedagent_flwr.fetch import DataFile, DownloadError, download_main, fetch_files

GITHUB = "https://github.com"
_RELEASES = "alfworld/alfworld/releases/download"
ARCHIVES: tuple[DataFile, ...] = (
    DataFile("downloads/json_2.1.1_json.zip", f"{_RELEASES}/0.2.2/json_2.1.1_json.zip"),
    DataFile("downloads/json_2.1.1_pddl.zip", f"{_RELEASES}/0.2.2/json_2.1.1_pddl.zip"),
    DataFile("downloads/json_2.1.2_tw-pddl.zip", f"{_RELEASES}/0.4.0/json_2.1.2_tw-pddl.zip"),
)


def unpack(archive: Path, data_dir: Path) -> None:
    """Merge ``archive`` into ``data_dir/json_2.1.1`` (its own top folder or bare split folders)."""
    marker = data_dir / "downloads" / f".{archive.name}.unpacked"
    if marker.exists():
        return
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=data_dir))
    try:
        with zipfile.ZipFile(archive) as bundle:
            bundle.extractall(staging)
        top = staging / DATA_VERSION_DIR if (staging / DATA_VERSION_DIR).is_dir() else staging
        if not any((top / split).is_dir() for split in SPLITS):
            raise DownloadError(f"{archive.name} holds no {'/'.join(SPLITS)} folders")
        for path in sorted(top.rglob("*")):
            if path.is_file():
                target = data_dir / DATA_VERSION_DIR / path.relative_to(top)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
    except zipfile.BadZipFile as exc:
        raise DownloadError(f"{archive} is not a valid zip archive ({exc}); delete it and run again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    marker.write_text("done\n")


def fetch_alfworld(data_dir: str | os.PathLike[str], base_url: str = GITHUB) -> dict[str, int]:
    """Download and unpack the archives into ``data_dir``; playable games per split."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    fetch_files(root, ARCHIVES, base_url, timeout_s=600.0)
    for item in ARCHIVES:
        unpack(root / item.name, root)
    counts = {}
    for split in SPLITS:
        try:
            counts[split] = len(load_games(root, split, num_games=0))
        except AlfWorldDataError:
            counts[split] = 0
    return counts


def _fetch_summary(data_dir: Path, base_url: str) -> str:
    counts = fetch_alfworld(data_dir, base_url)
    lines = []
    for split in SPLITS:
        note = "" if counts[split] == OFFICIAL_SPLIT_SIZES[split] else f" (official: {OFFICIAL_SPLIT_SIZES[split]})"
        lines.append(f"{split}: {counts[split]} playable games{note}")
    lines.append(f"ALFWorld data ready in {data_dir.resolve()} (set ALFWORLD_DATA or env.data_dir to it)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return download_main(argv, prog=program("python -m fedagent_flwr.envs.alfworld.download"),
                         description=__doc__.splitlines()[0], base_url=GITHUB,
                         base_url_help="a mirror laid out as <owner>/<repo>/releases/download/...",
                         download=_fetch_summary)


if __name__ == "__main__":
    raise SystemExit(main())
