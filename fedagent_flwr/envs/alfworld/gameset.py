"""Standard ALFWorld games from trials, and goal variants of one scene (runs in the service venv).

A game file (``game.tw-pddl``) is JSON with ALFWorld's PDDL domain, its text grammar with the
task description filled in, the trial's PDDL problem and a ``solvable`` flag; ALFWorld's own
``alfworld-generate`` writes it after checking the problem with a planner. :func:`build_game`
writes it the same way from ``initial_state.pddl`` + ``traj_data.json`` with the package's own
``alfred.pddl``/``alfred.twl2``, normalising the problem to ALFWorld's single agent (``agent1``;
the one public trial comes from a multi-agent branch), and sets ``solvable`` only after ALFWorld's
hand-coded expert has won the game, recording its winning command sequence in
``walkthrough.json`` beside it.

The official game set cannot be downloaded here, so :func:`build_variant_set` derives a small,
real set from one trial: the same scene (objects, receptacles, initial state) with other goals
from ALFRED's goal library (``alfworld.gen.goal_library``), one ``<task>-<obj>-<mrecep>-<recep>-<scene>``
trial directory each, in the standard ``json_2.1.1/<split>/`` layout. This is FedAgent's "cell"
idea (host scene + another goal); every game still runs on ALFWorld's engine and grammar.

Command line (under the service interpreter)::

    python -m fedagent_flwr.envs.alfworld.gameset --trial <trial dir> --out <ALFWORLD_DATA root>

From the trainer's side, :func:`ensure_variant_set` runs that under the service venv once and
keeps the result in the cache (keyed by the trial's files and this module), so tests, benchmarks
and demos share one build (about 30 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_EXPERT_STEPS = 50
_GOAL_RE = re.compile(r"\(:goal\b", re.IGNORECASE)


@dataclass(frozen=True)
class GoalVariant:
    """One ALFRED goal on the host scene, and the split its trial goes to."""

    task_type: str
    obj: str
    recep: str
    split: str = "train"
    mrecep: str = ""
    toggle: str = ""

    def task_dir(self, scene: str) -> str:
        return f"{self.task_type}-{self.obj}-{self.mrecep or 'None'}-{self.recep}-{scene}"


#: Goals on the one public trial's kitchen (FloorPlan14): five of ALFWorld's six task types (the
#: kitchen has no lamp for look_at_obj_in_light), objects and receptacles that exist there.
FLOORPLAN14_VARIANTS: tuple[GoalVariant, ...] = (
    GoalVariant("pick_heat_then_place_in_recep", "Potato", "SinkBasin"),  # the trial's own goal
    GoalVariant("pick_and_place_simple", "Apple", "Fridge"),
    GoalVariant("pick_clean_then_place_in_recep", "Cup", "Cabinet"),
    GoalVariant("pick_cool_then_place_in_recep", "Tomato", "CounterTop"),
    GoalVariant("pick_two_obj_and_place", "Mug", "CoffeeMachine"),
    GoalVariant("pick_and_place_simple", "Lettuce", "CounterTop"),
    GoalVariant("pick_heat_then_place_in_recep", "Egg", "CounterTop", split="valid_seen"),
    GoalVariant("pick_cool_then_place_in_recep", "Apple", "CounterTop", split="valid_seen"),
)


class GameBuildError(RuntimeError):
    """A trial that cannot be turned into a playable standard game."""


def standard_problem(problem: str) -> str:
    """The problem with ALFWorld's single agent ``agent1`` (extra agents and their facts dropped)."""
    agents = re.findall(r"^\s*(\S+)\s+-\s+agent\s*$", problem, flags=re.MULTILINE)
    if not agents:
        raise GameBuildError("the PDDL problem declares no agent")
    first, extra = agents[0], agents[1:]
    for name in extra:
        problem = re.sub(rf"^\s*{re.escape(name)}\s+-\s+agent\s*\n", "", problem, flags=re.MULTILINE)
        problem = re.sub(rf"^\s*\([^()]*\b{re.escape(name)}\b[^()]*\)\s*\n", "", problem, flags=re.MULTILINE)
    return re.sub(rf"\b{re.escape(first)}\b", "agent1", problem)


def with_goal(problem: str, variant: GoalVariant) -> str:
    """The problem with its ``(:goal ...)`` replaced by ALFRED's goal for ``variant``."""
    import alfworld.gen.goal_library as goal_library

    match = _GOAL_RE.search(problem)
    if match is None:
        raise GameBuildError("the PDDL problem has no (:goal ...) block")
    template = goal_library.gdict[variant.task_type]["pddl"]
    # The library writes '#' for PDDL's '-' type separator (it is a str.format template).
    goal = template.format(obj=variant.obj, recep=variant.recep, mrecep=variant.mrecep,
                           toggle=variant.toggle).replace("#", "-")
    return problem[: match.start()] + goal.strip() + "\n"


def variant_traj_data(traj: dict[str, Any], variant: GoalVariant, trial: str) -> dict[str, Any]:
    """``traj_data.json`` for a variant: the host's scene, the variant's task and parameters."""
    import alfworld.gen.goal_library as goal_library

    desc = goal_library.gdict[variant.task_type]["templates"][0].format(
        obj=variant.obj.lower(), recep=variant.recep.lower(), mrecep=variant.mrecep.lower(),
        toggle=variant.toggle.lower())
    out = {key: value for key, value in traj.items() if key not in ("plan", "images")}
    out["task_type"] = variant.task_type
    out["task_id"] = trial
    out["pddl_params"] = {"object_target": variant.obj, "parent_target": variant.recep,
                          "mrecep_target": variant.mrecep, "toggle_target": variant.toggle,
                          "object_sliced": False}
    out["turk_annotations"] = {"anns": [{"task_desc": desc[0].upper() + desc[1:] + ".", "high_descs": [],
                                         "assignment_id": "generated", "votes": []}]}
    return out


def build_game(trial_dir: str | Path) -> list[str]:
    """Write ``game.tw-pddl`` for ``trial_dir`` and verify it with the expert; the winning commands.

    Raises :class:`GameBuildError` when the expert cannot win within 50 commands (the file is then
    written with ``"solvable": false``, which ALFWorld's loaders skip).
    """
    from alfworld.agents.utils.misc import add_task_to_grammar
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    trial = Path(trial_dir).resolve()
    traj = json.loads((trial / "traj_data.json").read_text())
    problem = (trial / "initial_state.pddl").read_text()
    # The grammar's task text is a template choice; a fixed seed makes the game file reproducible.
    state = random.getstate()
    random.seed(0)
    try:
        grammar = add_task_to_grammar(Path(ALFRED_TWL2_PATH).read_text(), traj)
    finally:
        random.setstate(state)
    game = {"pddl_domain": Path(ALFRED_PDDL_PATH).read_text(), "grammar": grammar, "pddl_problem": problem,
            "solvable": False}
    game_file = trial / "game.tw-pddl"
    game_file.write_text(json.dumps(game))
    walkthrough = expert_walkthrough(game_file)
    game["solvable"] = True
    game_file.write_text(json.dumps(game))
    (trial / "walkthrough.json").write_text(json.dumps(walkthrough) + "\n")
    return walkthrough


def expert_walkthrough(game_file: Path) -> list[str]:
    """Play ALFWorld's hand-coded expert on ``game_file``; its commands if it wins."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "expert_plan"])
    env = textworld.start(str(game_file), infos, wrappers=[AlfredDemangler(), AlfredInfos, AlfredExpert])
    try:
        state = env.reset()
        commands: list[str] = []
        for _ in range(MAX_EXPERT_STEPS):
            command = state["extra.expert_plan"][0]
            state, _score, _done = env.step(command)
            commands.append(command)
            if state["won"]:
                if len(commands) < 2:  # "look" won: the goal holds from the start
                    raise GameBuildError(f"the goal of {game_file} already holds in the initial state")
                return commands
    finally:
        env.close()
    raise GameBuildError(f"ALFWorld's expert did not win {game_file} within {MAX_EXPERT_STEPS} commands")


def build_variant_set(source_trial: str | Path, out_root: str | Path,
                      variants: Sequence[GoalVariant] = FLOORPLAN14_VARIANTS) -> list[Path]:
    """Write one verified trial per variant under ``out_root/json_2.1.1/<split>/``; their game files."""
    source = Path(source_trial).resolve()
    traj = json.loads((source / "traj_data.json").read_text())
    problem = standard_problem((source / "initial_state.pddl").read_text())
    scene = str(traj["scene"]["floor_plan"]).removeprefix("FloorPlan")
    base_trial = source.name if source.name.startswith("trial_") else "trial_T00000000_000000_000000"
    games = []
    for number, variant in enumerate(variants):
        trial = f"{base_trial}_v{number}"
        trial_dir = Path(out_root) / "json_2.1.1" / variant.split / variant.task_dir(scene) / trial
        if trial_dir.exists():
            shutil.rmtree(trial_dir)
        trial_dir.mkdir(parents=True)
        (trial_dir / "traj_data.json").write_text(json.dumps(variant_traj_data(traj, variant, trial)))
        (trial_dir / "initial_state.pddl").write_text(with_goal(problem, variant))
        build_game(trial_dir)
        games.append(trial_dir / "game.tw-pddl")
    return games


def ensure_variant_set(source_trial: str | Path) -> Path:
    """An ``ALFWORLD_DATA`` root holding :data:`FLOORPLAN14_VARIANTS` built from ``source_trial``.

    Built under the service interpreter (building the service venv first if needed) into the cache,
    in a temporary directory renamed into place, so concurrent callers build once.
    """
    from fedagent_flwr.envs.alfworld.service_venv import build_with_service_python, venv_name

    source = Path(source_trial).resolve()
    digest = hashlib.sha256(venv_name().encode())
    for name in ("traj_data.json", "initial_state.pddl"):
        digest.update((source / name).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return build_with_service_python(
        f"alfworld-variants-{digest.hexdigest()[:12]}", "json_2.1.1", __name__,
        lambda work: ["--trial", str(source), "--out", str(work)],
        GameBuildError, "building the ALFWorld variant set failed")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: build the FloorPlan14 variant set from a trial directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trial", required=True, help="trial directory with traj_data.json and initial_state.pddl")
    parser.add_argument("--out", required=True, help="ALFWORLD_DATA root to write json_2.1.1/ under")
    args = parser.parse_args(argv)
    try:
        games = build_variant_set(args.trial, args.out)
    except (GameBuildError, OSError, KeyError, ValueError) as exc:
        print(f"alfworld gameset: {exc}", file=sys.stderr)
        return 1
    for game in games:
        print(game)
    return 0


if __name__ == "__main__":
    sys.exit(main())
