"""End to end: a real Flower simulation (reference trainer, tiny model, TinyGuess) whose token budget
cuts some of its episodes short, and the server saying so.

The env spec, for training and validation alike, has two TinyGuess entries that differ only in
``max_turns``: 1 and 3. Their first prompt is 120 tokens with the SmolLM2 tokenizer, so with
``trainer.max_new_tokens=8`` and ``trainer.max_model_len=132`` every episode plays its first turn (128
tokens), and no second turn fits (the reply, the template glue and the next observation, >= 11 tokens,
and 8 more to sample): the 1-turn entry's episodes end normally, the 3-turn entry's are truncated
after their first guess unless it won. Some but not all episodes are truncated, none is refused
(``check_turns_fit`` refuses only a rollout that played no turn at all), and the run ends normally.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedagent_flwr.serverapp.recorder import METRICS_FILE
from testkit.flower_harness import SuperLink

pytestmark = pytest.mark.slow

ENVS = ("[{name:TinyGuess,n_envs:1,max_turns:1,config:{lo:1,hi:10}},"
        "{name:TinyGuess,n_envs:1,max_turns:3,config:{lo:1,hi:10}}]")


def _truncated_share(result_file: Path) -> float:
    """The share the client's trainer measured, from the job's own result file."""
    return float(json.loads(result_file.read_text())["metrics"]["truncated_rate"])


def test_truncated_episodes_are_warned_about_and_recorded(superlink: SuperLink, tmp_path: Path,
                                                          tiny_model_dir: Path) -> None:
    proc = superlink.run(
        f"output_dir={tmp_path} run_name=job model.path={tiny_model_dir} experiment=centralized num_rounds=1 "
        f"env.train.envs={ENVS} env.val.envs={ENVS} eval.num_episodes=2 eval.per_client=true "
        "trainer.max_new_tokens=8 trainer.max_model_len=132 trainer.mode=persistent",
        supernodes=1,
    )
    output = proc.stdout + proc.stderr
    run_dir = tmp_path / "job"
    summary_path = run_dir / "federated_summary.json"
    assert summary_path.exists(), output[-4000:]
    summary = json.loads(summary_path.read_text())
    # A budget setting lowers the numbers; it does not change how the run ends: the run ends as the
    # existing rules say (a random tiny model's groups all score alike, so GRPO often has no learning
    # signal and the run is degraded for that), with no word of truncation in its status reason.
    assert summary["status"] in ("completed", "degraded") and summary["last_completed_round"] == 1, output[-4000:]
    assert "truncat" not in summary.get("warning", "")

    # What the client's jobs measured: some, not all, of each rollout's episodes were truncated.
    train_share = _truncated_share(run_dir / "round_1" / "client_0" / "train_result.json")
    val_shares = {r: _truncated_share(run_dir / f"round_{r}" / "eval" / "client_0" / "eval_result.json")
                  for r in (0, 1)}
    own_share = _truncated_share(run_dir / "round_1" / "client_0" / "client_val" / "eval_result.json")
    for share in (train_share, *val_shares.values(), own_share):
        assert 0.0 < share < 1.0

    # The summary carries each share on its curve point ...
    (train_point,) = summary["client_curve"]
    assert train_point["truncated_rate"] == pytest.approx(train_share)
    assert [(p["round"], p["truncated_rate"], p["truncated"]) for p in summary["val_curve"]] == [
        (r, pytest.approx(val_shares[r]), {"0": pytest.approx(val_shares[r])}) for r in (0, 1)]
    (own_point,) = summary["client_val_curve"]
    assert own_point["truncated_rate"] == pytest.approx(own_share)
    # ... and a top-level note naming where, how much and the keys to change.
    truncation = summary["truncation"]
    assert [(e["round"], e["client"]) for e in truncation["training"]] == [(1, 0)]
    assert [(e["round"], e["model"], e["clients"]) for e in truncation["validation"]] == [
        (0, "base", {"0": pytest.approx(val_shares[0])}), (1, "aggregated", {"0": pytest.approx(val_shares[1])})]
    assert [(e["round"], e["client"]) for e in truncation["per_client_validation"]] == [(1, 0)]
    assert truncation["max_share"] == pytest.approx(max(train_share, own_share, *val_shares.values()))
    assert "trainer.max_model_len" in truncation["note"] and "trainer.max_new_tokens" in truncation["note"]

    # metrics.jsonl: the training event's metrics and the evaluation events carry the shares too.
    events = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    (train_event,) = [e for e in events if e["event"] == "train"]
    assert train_event["metrics"]["truncated-rate"] == pytest.approx(train_share)
    assert [e["truncated_rate"] for e in events if e["event"] == "evaluate"] == [
        pytest.approx(val_shares[0]), pytest.approx(val_shares[1])]

    # The ServerApp's log: one warning per round, client and phase, with the share and the keys.
    warnings = [line for line in output.splitlines() if re.search(r"round \d+: \d+% of client \d+'s ", line)]
    expected = [(0, "validation", val_shares[0]), (1, "training", train_share),
                (1, "per-client validation", own_share), (1, "validation", val_shares[1])]
    assert len(warnings) == len(expected), "\n".join(warnings) or output[-4000:]
    for (server_round, phase, share), line in zip(expected, warnings):
        assert "WARNING" in line
        assert f"round {server_round}: {share:.0%} of client 0's {phase} episodes" in line, line
        assert "raise trainer.max_model_len or lower trainer.max_new_tokens" in line, line
    assert f"run {summary['status']}, but some episodes were truncated" in output, output[-4000:]
