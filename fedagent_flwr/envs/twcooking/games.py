"""TextWorld cooking games generated offline with ``tw-make`` (the service venv ships the compiler).

A *level* is a set of ``tw-make tw-cooking`` settings (recipe size, ingredients to find, rooms,
whether containers must be opened and ingredients cooked or cut). A game set is ``per_level``
games of each level, for a split (``train`` and ``valid`` use disjoint recipes and ingredients, so
validation is out of distribution), each with its own seed, listed in a manifest
(``games.json``: file, level, seed, walkthrough) in level order. Generating a game takes 5-12 s;
:func:`ensure_game_set` runs the generator once under the service interpreter and keeps the set
in the cache, keyed by its settings.

Command line (under the service interpreter)::

    python -m fedagent_flwr.envs.twcooking.games --out DIR --levels JSON --per-level N --seed S --split train
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Named levels, easiest first (FedAgent has no TextWorld arm; these span tw-cooking's knobs).
LEVELS: dict[str, dict[str, Any]] = {
    "easy": {"recipe": 1, "take": 1, "go": 1},
    "medium": {"recipe": 2, "take": 1, "go": 1, "open": True, "cut": True},
    "hard": {"recipe": 2, "take": 2, "go": 6, "open": True, "cook": True, "cut": True},
    "expert": {"recipe": 3, "take": 3, "go": 9, "open": True, "cook": True, "cut": True},
}
SPLITS = ("train", "valid")
_INT_KNOBS = ("recipe", "take", "go")
_FLAG_KNOBS = ("open", "cook", "cut", "drop")


class GameSetError(ValueError):
    """Game-set settings that cannot be generated, or a generation that failed."""


def resolve_levels(levels: Sequence[str | Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, settings) of each level: a name from :data:`LEVELS` or ``{name, <knobs>}``."""
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Sequence) or not levels:
        raise GameSetError(f"levels must be a non-empty list of level names or settings, got {levels!r}")
    resolved = []
    for level in levels:
        if isinstance(level, str):
            if level not in LEVELS:
                raise GameSetError(f"unknown level {level!r} (known: {', '.join(LEVELS)})")
            resolved.append((level, dict(LEVELS[level])))
            continue
        if not isinstance(level, Mapping) or not isinstance(level.get("name"), str):
            raise GameSetError(f"a level must be a name or a mapping with a 'name', got {level!r}")
        unknown = set(level) - {"name", *_INT_KNOBS, *_FLAG_KNOBS}
        if unknown:
            raise GameSetError(f"level {level['name']!r} has unknown settings {sorted(unknown)}")
        resolved.append((level["name"], {k: v for k, v in level.items() if k != "name"}))
    names = [name for name, _ in resolved]
    if len(set(names)) != len(names):
        raise GameSetError(f"level names must be distinct, got {names}")
    return resolved


def tw_make_args(settings: Mapping[str, Any], seed: int, split: str, output: Path) -> list[str]:
    """``tw-make tw-cooking`` arguments for one game."""
    args = ["tw-cooking"]
    for knob in _INT_KNOBS:
        if knob in settings:
            args += [f"--{knob}", str(int(settings[knob]))]
    args += [f"--{knob}" for knob in _FLAG_KNOBS if settings.get(knob)]
    return args + ["--split", split, "--seed", str(int(seed)), "--output", str(output), "--silent", "-f"]


def generate(
    out: Path, levels: Sequence[tuple[str, dict[str, Any]]], per_level: int, seed: int, split: str
) -> list[dict]:
    """Generate the set into ``out`` (under the service interpreter); the manifest entries."""
    import textworld

    tw_make = Path(sys.executable).parent / "tw-make"
    entries = []
    for level_index, (name, settings) in enumerate(levels):
        for k in range(per_level):
            game_seed = seed + 1000 * level_index + k
            output = out / f"{name}-{split}-{game_seed}.z8"
            proc = subprocess.run([sys.executable, str(tw_make), *tw_make_args(settings, game_seed, split, output)],
                                  capture_output=True, text=True)
            if proc.returncode != 0 or not output.is_file():
                raise GameSetError(
                    f"tw-make failed for level {name!r} seed {game_seed}:\n{(proc.stderr or proc.stdout)[-2000:]}"
                )
            walkthrough = textworld.Game.load(str(output.with_suffix(".json"))).walkthrough
            entries.append({"file": output.name, "level": name, "seed": game_seed, "split": split,
                            "walkthrough": list(walkthrough or [])})
    (out / "games.json").write_text(json.dumps({"levels": dict(levels), "games": entries}, indent=1) + "\n")
    return entries


def ensure_game_set(levels: Sequence[str | Mapping[str, Any]], per_level: int, seed: int, split: str) -> Path:
    """Directory of the game set (``games.json`` + ``.z8`` files), generated once and cached."""
    from fedagent_flwr.cache import cache_dir
    from fedagent_flwr.envs.alfworld.service_venv import venv_name

    resolved = resolve_levels(levels)
    if split not in SPLITS:
        raise GameSetError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(per_level, bool) or not isinstance(per_level, int) or per_level < 1:
        raise GameSetError(f"games_per_level must be an integer >= 1, got {per_level!r}")
    key = json.dumps([resolved, per_level, int(seed), split, venv_name()], sort_keys=True)
    name = f"twcooking-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (cache_dir() / name / "games.json").is_file():  # the usual case, and the only one in a service
        return cache_dir() / name
    from fedagent_flwr.envs.alfworld.service_venv import build_with_service_python

    return build_with_service_python(
        name, "games.json", __name__,
        lambda work: ["--out", str(work), "--levels", json.dumps(resolved), "--per-level", str(per_level),
                      "--seed", str(int(seed)), "--split", split],
        GameSetError, "generating TextWorld cooking games failed")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: generate one game set (run under the service interpreter)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--levels", required=True, help='JSON list of [name, settings] pairs')
    parser.add_argument("--per-level", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--split", choices=SPLITS, required=True)
    args = parser.parse_args(argv)
    try:
        levels = [(str(name), dict(settings)) for name, settings in json.loads(args.levels)]
        entries = generate(args.out, levels, args.per_level, args.seed, args.split)
    except (GameSetError, ValueError, OSError) as exc:
        print(f"twcooking games: {exc}", file=sys.stderr)
        return 1
    print(f"{len(entries)} games in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
