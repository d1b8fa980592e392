"""Console scripts for a ``pip install --target`` tree (which gets none): one small launcher per
entry point of every distribution in SITE, written to BIN. Flower needs them: ``flwr run`` starts
``flower-superlink``, which starts ``flower-superexec`` and ``flwr-simulation`` by name.

usage: python3 tools/gpu/make_bin.py SITE BIN
"""

from __future__ import annotations

import configparser
import sys
from pathlib import Path


def write_launchers(site: Path, bin_dir: Path) -> list[str]:
    """Write ``bin_dir/<name>`` for every ``console_scripts`` entry point found under ``site``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for entry_points in sorted(site.glob("*.dist-info/entry_points.txt")):
        parser = configparser.ConfigParser(interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read(entry_points)
        if not parser.has_section("console_scripts"):
            continue
        for name, target in parser.items("console_scripts"):
            module, _, attr = target.partition(":")
            script = bin_dir / name
            script.write_text(
                f"#!{sys.executable}\n"
                "import sys\n"
                f"from {module.strip()} import {attr.strip().split('.')[0]} as _entry\n"
                f"sys.exit(_entry{''.join('.' + p for p in attr.strip().split('.')[1:])}())\n"
            )
            script.chmod(0o755)
            names.append(name)
    return names


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    written = write_launchers(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{len(written)} launchers in {sys.argv[2]}")
