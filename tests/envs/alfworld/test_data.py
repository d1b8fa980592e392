"""ALFWorld game data: the standard layout's rules, FedAgent's order, the env's pool, the service
venv's bookkeeping and the download command (against a real HTTP mirror on loopback).

The layout tests write trial folders whose ``game.tw-pddl`` carries only the ``solvable`` flag:
they check which folders the loader accepts and in which order, which is all it reads.
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fedagent_flwr.envs.alfworld import data as alf_data
from fedagent_flwr.envs.alfworld.data import AlfWorldDataError, load_games
from fedagent_flwr.envs.alfworld.env import FALLBACK_CHARS, AlfWorldEnv, format_observation
from fedagent_flwr.envs.base import EnvConfigError
from fedagent_flwr.envs.projection import project_action

GOOD = [
    ("pick_and_place_simple-Apple-None-Fridge-14", "trial_T1"),
    ("pick_clean_then_place_in_recep-Mug-None-Cabinet-2", "trial_T2"),
    ("pick_heat_then_place_in_recep-Egg-None-CounterTop-301", "trial_T3"),
    ("look_at_obj_in_light-Book-None-DeskLamp-301", "trial_T4"),
    ("pick_two_obj_and_place-Cup-None-Shelf-7", "trial_T5"),
    ("pick_two_obj_and_place-Cup-None-Shelf-7", "trial_T6"),
    ("pick_cool_then_place_in_recep-Tomato-None-Fridge-14", "trial_T7"),
]


def _trial(root: Path, split: str, task_dir: str, trial: str, game: dict | None) -> None:
    folder = root / "json_2.1.1" / split / task_dir / trial
    folder.mkdir(parents=True)
    (folder / "traj_data.json").write_text("{}")
    if game is not None:
        (folder / "game.tw-pddl").write_text(json.dumps(game))


@pytest.fixture()
def layout(tmp_path: Path) -> Path:
    for split in ("train", "valid_seen"):
        for task_dir, trial in GOOD:
            _trial(tmp_path, split, task_dir, trial, {"solvable": True})
        # What ALFWorld's collect_game_files skips:
        _trial(tmp_path, split, "pick_and_place_simple-Bowl-None-Sink-1", "trial_unsolvable", {"solvable": False})
        _trial(tmp_path, split, "pick_and_place_simple-Bowl-None-Sink-1", "trial_unchecked", {})
        _trial(tmp_path, split, "pick_and_place_simple-Bowl-None-Sink-1", "trial_nogame", None)
        _trial(tmp_path, split, "pick_and_place_with_movable_recep-Pen-Mug-Desk-3", "trial_m", {"solvable": True})
        _trial(tmp_path, split, "pick_heat_then_place_in_recep-AppleSliced-None-Fridge-3", "trial_s",
               {"solvable": True})
    return tmp_path


def test_only_playable_games_in_fedagent_order(layout: Path) -> None:
    games = load_games(layout, "train")
    expected = sorted(str(layout / "json_2.1.1" / "train" / d / t / "game.tw-pddl") for d, t in GOOD)
    random.Random(42).shuffle(expected)
    assert [g.game_file for g in games] == expected
    other = [g.game_file for g in load_games(layout, "train", shuffle_seed=7)]
    assert sorted(other) == sorted(expected) and other != expected
    # Evaluation splits are always shuffled with 42, whatever the train shuffle seed.
    assert ([g.game_file for g in load_games(layout, "valid_seen", shuffle_seed=7)]
            == [g.game_file for g in load_games(layout, "valid_seen")])


def test_caps_and_task_type_filter(layout: Path) -> None:
    full = load_games(layout, "train")
    assert load_games(layout, "train", num_games=3) == full[:3]  # FedAgent's num_train_games: a prefix
    evals = load_games(layout, "valid_seen")
    sampled = load_games(layout, "valid_seen", num_games=3)
    assert list(sampled) == random.Random(42).sample(list(evals), 3)
    two = load_games(layout, "train", task_types=["pick_two_obj_and_place"])
    assert {g.task_type for g in two} == {"pick_two_obj_and_place"} and len(two) == 2


def test_game_record_names_what_partitions_need(layout: Path) -> None:
    (game,) = [g for g in load_games(layout, "train") if g.trial == "trial_T3"]
    assert game.task_type == "pick_heat_then_place_in_recep" and game.scene == "301"
    assert game.spec == "pick_heat_then_place_in_recep-Egg-None-CounterTop"
    assert game.task_id == "alfworld_pick_heat_then_place_in_recep-Egg-None-CounterTop-301_trial_T3_game"


def test_bad_data_is_named(tmp_path: Path, layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(AlfWorldDataError, match="set env.data_dir \\(or the environment variable ALFWORLD_DATA\\)"):
        load_games(None, "train")
    download = "fetch the data with: python -m fedagent_flwr.envs.alfworld.download"
    with pytest.raises(AlfWorldDataError, match=f"has no json_2.1.1/ directory; {download}"):
        load_games(tmp_path / "elsewhere", "train")
    with pytest.raises(AlfWorldDataError, match="split must be one of"):
        load_games(layout, "test")
    with pytest.raises(AlfWorldDataError, match="has no json_2.1.1/valid_unseen/"):
        load_games(layout, "valid_unseen")
    with pytest.raises(AlfWorldDataError, match="unknown ALFWorld task types"):
        load_games(layout, "train", task_types=["make_coffee"])
    monkeypatch.setenv("ALFWORLD_DATA", str(layout))
    assert len(load_games(None, "train")) == len(GOOD)


def test_env_pool_seeds_and_restrictions(layout: Path) -> None:
    config = {"data_dir": str(layout), "split": "train"}
    games = load_games(layout, "train")
    env = AlfWorldEnv(config)
    assert AlfWorldEnv.num_goals(config) == len(GOOD)
    assert env.game_for_seed(9) == games[9 % len(GOOD)]
    restricted = AlfWorldEnv.restrict_goals(config, [2, 5])
    env = AlfWorldEnv(restricted)
    assert env.game_for_seed(11) == games[[2, 5][random.Random(11).randrange(2)]]
    assert AlfWorldEnv.restrict_goals(restricted, [1])["goal_indices"] == [5]  # restrictions compose
    with pytest.raises(EnvConfigError, match=r"goal indices \[7\] are outside the pool of 7"):
        AlfWorldEnv.restrict_goals(config, [7])
    with pytest.raises(EnvConfigError, match="'max_turns' must be an integer >= 1"):
        AlfWorldEnv({**config, "max_turns": 0})
    info = AlfWorldEnv.goal_info(config)
    assert [i.task_id for i in info] == [g.task_id for g in games]


def test_projection_and_observation_format() -> None:
    assert project_action("<think>hot</think><action>Heat Potato 2 with Microwave 1</action>", FALLBACK_CHARS) == (
        "heat potato 2 with microwave 1", True)
    text = "I am not sure what to do here, maybe go to fridge 1"
    assert project_action(text, FALLBACK_CHARS) == (text.lower()[-30:], False)
    assert project_action("<action>look</action>", FALLBACK_CHARS) == ("look", False)  # no <think>
    assert format_observation("You see a fridge 1.", ["go to fridge 1", "look"]) == (
        "Your current observation is: You see a fridge 1.\n"
        "Your admissible actions of the current situation are: ['go to fridge 1'\n 'look'].")


def test_service_venv_bookkeeping(tmp_path: Path) -> None:
    from fedagent_flwr.envs.alfworld.service_venv import REQUIREMENTS, venv_name

    assert venv_name().startswith("alfworld-0.4.2-textworld-1.7.0-py3")
    assert "alfworld==0.4.2" in REQUIREMENTS and "textworld==1.7.0" in REQUIREMENTS
    check = [sys.executable, "-m", "fedagent_flwr.envs.alfworld.service_venv", "--check"]
    empty = subprocess.run(check, capture_output=True, text=True, env={"FEDAGENT_CACHE_DIR": str(tmp_path), "PATH": ""})
    assert empty.returncode == 1 and "not built" in empty.stderr and str(tmp_path) in empty.stderr
    missing = subprocess.run(check, capture_output=True, text=True,
                             env={"FEDAGENT_ALFWORLD_PYTHON": str(tmp_path / "python"), "PATH": ""})
    assert missing.returncode == 1 and "does not exist" in missing.stderr


# --- download -----------------------------------------------------------------------------------


@pytest.fixture()
def mirror(tmp_path: Path, alfworld_data: Path) -> Iterator[str]:
    """ALFWorld's three release archives, rebuilt from the local game set, on a real HTTP server."""
    from fedagent_flwr.envs.alfworld.download import ARCHIVES

    root = tmp_path / "mirror"
    members = {"_json.zip": "traj_data.json", "_pddl.zip": "initial_state.pddl", "_tw-pddl.zip": "game.tw-pddl"}
    for item in ARCHIVES:
        target = root / item.source
        target.parent.mkdir(parents=True, exist_ok=True)
        member = next(name for suffix, name in members.items() if item.source.endswith(suffix))
        with zipfile.ZipFile(target, "w") as bundle:
            for path in sorted((alfworld_data / "json_2.1.1").rglob(member)):
                bundle.write(path, str(path.relative_to(alfworld_data)))
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_download_unpacks_the_standard_layout(mirror: str, tmp_path: Path, alfworld_data: Path) -> None:
    from fedagent_flwr.envs.alfworld.download import fetch_alfworld, main

    data = tmp_path / "data"
    alf_data._GAMES.clear()
    assert fetch_alfworld(data, mirror) == {"train": 6, "valid_seen": 2, "valid_unseen": 0}
    ours = [g.game_file.replace(str(data), "") for g in load_games(data, "train")]
    theirs = [g.game_file.replace(str(alfworld_data), "") for g in load_games(alfworld_data, "train")]
    assert ours == theirs  # same games, same order
    assert main([str(data), "--base-url", mirror]) == 0  # a second run keeps everything
    assert not list(data.glob(".unpack-*"))


def test_download_without_network_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedagent_flwr.envs.alfworld.download import main

    assert main([str(tmp_path / "data"), "--base-url", "http://127.0.0.1:9"]) == 1
    assert "cannot fetch http://127.0.0.1:9/alfworld/alfworld/releases/" in capsys.readouterr().err
