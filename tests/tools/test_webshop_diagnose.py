"""``tools/webshop_diagnose.py --rollouts``: GRPO-style groups of episodes per goal, played through the
real in-process WebShop environment and the project's sampler, and the table rows that count the
groups with a spread; ``--reread``: a recorded run's groups re-scored under a reward mode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from testkit.webshop_data import DATA_DIR, needs_data

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "webshop_diagnose.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("webshop_diagnose", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_group_spread_counts_goals_whose_returns_or_row_scores_differ(capsys: pytest.CaptureFixture[str]) -> None:
    # Goal 1: returns 0, 0, 1 (mixed). Goal 2: returns all 0, but one turn row lost the penalty, so
    # its rows differ; goal 3 has a single row, which has no spread and is left out of the rows' count.
    returns = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    episode_goals = [1, 1, 1, 2, 2, 2, 3, 3, 3]
    row_scores = [0.0, 0.0, 1.0, 0.0, -0.1, 0.0, 0.0]
    row_goals = [1, 1, 1, 2, 2, 2, 3]
    _tool().print_group_spread(returns, row_scores, row_goals, 3, episode_goals)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| groups (3 rollouts a goal) whose returns differ (a task signal) | 1/3 ")
    assert lines[1].startswith("| groups (3 rollouts a goal) whose row scores differ (what GRPO sees) | 2/2 ")
    assert "Wilson 95% [0.34, 1.00]" in lines[1]


@needs_data
def test_a_goals_first_rollout_is_the_episode_a_single_run_plays(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Groups add rollouts without changing what a run of one episode a goal plays, so a group probe
    # stays comparable with the single-episode diagnoses already recorded.
    def run(rollouts: int) -> tuple[str, list[dict[str, object]]]:
        out = tmp_path / f"turns-{rollouts}.jsonl"
        done = subprocess.run(
            [sys.executable, str(TOOL), "--data-dir", str(DATA_DIR), "--model", str(tiny_model_dir),
             "--episodes", "2", "--rollouts", str(rollouts), "--split", "train", "--mode", "windowed",
             "--max-turns", "2", "--max-new-tokens", "8", "--max-model-len", "4096", "--show", "0",
             "--json", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": str(REPO), "DIAG_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout, [json.loads(line) for line in out.read_text().splitlines()]

    single_out, single = run(1)
    grouped_out, grouped = run(3)
    assert "rollouts a goal" not in single_out
    assert "| groups (3 rollouts a goal) whose returns differ (a task signal) | " in grouped_out
    assert "| groups (3 rollouts a goal) whose row scores differ (what GRPO sees) | " in grouped_out
    first_of_each_goal = [row for row in grouped if row["seed"] in (0, 1)]
    turns_per_episode = {seed: sum(1 for row in single if row["seed"] == seed) for seed in (0, 1)}
    # --json lists episodes in play order: a goal's rollouts one after another, its first one first.
    firsts = []
    for seed in (0, 1):
        rows = [row for row in first_of_each_goal if row["seed"] == seed]
        firsts += rows[: turns_per_episode[seed]]
    assert [r["reply"] for r in firsts] == [r["reply"] for r in single]
    assert len({r["reply"] for r in grouped}) > len({r["reply"] for r in single})  # other rollouts, other replies


def test_the_context_is_verls_sum_when_both_budgets_are_given() -> None:
    import argparse

    tool = _tool()
    parser = argparse.ArgumentParser()
    assert tool.token_bounds(parser, None, 4096, 512) == tool.TokenBounds(4608, 4096, 512)
    assert tool.token_bounds(parser, 4608, 4096, 512) == tool.TokenBounds(4608, 4096, 512)
    assert tool.token_bounds(parser, None, None, None) == tool.TokenBounds(3072)
    with pytest.raises(SystemExit):  # argparse's error: a context that is not the two budgets' sum
        tool.token_bounds(parser, 3072, 4096, 512)


PROBE = REPO / "docs" / "gpu-runs" / "2026-12-05" / "warm-start-grpo-probe-cpu" / "probe-turns.jsonl"


@pytest.mark.parametrize(("reward", "spread"), [("success", "0/4"), ("score", "3/4")])
def test_reread_of_the_cpu_probe_under_each_reward(
    reward: str, spread: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The 2026-12-05 probe (windowed, 4 goals x 8): every purchase below 1.0, so FedAgent's reward is
    # flat in all four groups (as its log says); the graded reward differs within goals 600-602.
    _tool().reread(PROBE, reward, "windowed", 0.1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"| episodes re-read (reward {reward}) | 32 |"
    for label in ("returns differ (a task signal)", "row scores differ (what GRPO sees)"):
        assert any(line.startswith(f"| groups (8 rollouts a goal) whose {label} | {spread} ") for line in lines)
    if reward == "success":
        assert lines[1] == "| return distribution | {0.0: 32} |"
        recorded = [json.loads(line)["reward"] for line in PROBE.read_text().splitlines()]
        assert recorded == [0.0] * 149  # the re-read mapping reproduces what the run recorded
    else:
        assert "{0.0: 2, 2.857: 7, 4.0: 8," in lines[1]


def test_reread_windowed_rows_and_concat_episodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two goals x 2 rollouts. Goal 0 bought at 0.5 and 1.0: differs in both modes. Goal 1 bought at 0.5
    # twice, one episode with an invalid turn: returns equal, but its rows differ (penalty) in both layouts.
    def turn(seed: int, n: int, score: float, done: bool, valid: int = 1) -> dict[str, object]:
        return {"seed": seed, "turn": n, "task_score": score, "done": done, "format_valid": valid}

    rows = [turn(0, 1, 0.0, False), turn(0, 2, 0.5, True), turn(0, 1, 1.0, True),
            turn(1, 1, 0.5, True), turn(1, 1, 0.0, False, 0), turn(1, 2, 0.5, True)]
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tool = _tool()
    for mode in ("windowed", "concat"):
        tool.reread(path, "score", mode, 0.1)
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == "| return distribution | {5.0: 3, 10.0: 1} |"
        assert lines[2].startswith("| groups (2 rollouts a goal) whose returns differ (a task signal) | 1/2 ")
        assert lines[3].startswith("| groups (2 rollouts a goal) whose row scores differ (what GRPO sees) | 2/2 ")
    tool.reread(path, "success", "windowed", 0.1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| groups (2 rollouts a goal) whose returns differ (a task signal) | 1/2 ")
