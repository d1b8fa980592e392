"""Issue 19 on CPU: a verl client at FSDP world size 2 beside one at world size 1, aggregated,
audited, and loaded back into a live 2-rank actor (:mod:`testkit.verl_world` runs the round in
two gloo processes with verl's own FSDP engine; this module checks what they report)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedagent_flwr.trainers.common.client_rule import job_rule_specs
from fedagent_flwr.trainers.common.fedprox import FEDPROX_RULE
from fedagent_flwr.trainers.verl import job as verl_job
from testkit import verl_world

Reports = tuple[Path, list[dict[str, Any]], float]


@pytest.fixture(scope="module")
def reports(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Reports:
    """One round: (its directory, each process's report, wall seconds)."""
    root = tmp_path_factory.mktemp("world_size_2")
    # The environment a FedProx job gives its verl processes (the hooks' sitecustomize reads it).
    env = verl_job.job_environment({}, rules=job_rule_specs(verl_world.MU, {}), marker_dir=str(root / "markers"))
    env["FEDAGENT_WEIGHT_SYNC_LOCK"] = "off"  # no vLLM here
    started = time.monotonic()
    found = verl_world.run(root, tiny_model_dir, env)
    return root, found, time.monotonic() - started


def test_the_aggregate_of_world_sizes_2_and_1_matches_an_independent_mean(reports: Reports) -> None:
    root, (rank0, _), _ = reports
    server = rank0["server"]
    assert server["world_sizes"] == {"0": 2, "1": 1}
    assert server["entry"]["client_actor_ids"] == [0, 1] and not server["entry"].get("rejected")
    assert server["verify_rc"] == 0  # python -m fedagent_flwr.checkpoint.verify: max abs error <= 1e-6
    # An oracle that shares no code with our reader: torch's FULL_STATE_DICT of each client's actor.
    clients = [torch.load(root / "oracle" / f"client{c}.pt") for c in (0, 1)]
    weights = [verl_world.CLIENT_EPISODES[c] for c in (0, 1)]
    aggregate = load_file(str(Path(server["global"]) / "model.safetensors"))
    assert set(aggregate) == set(clients[0]) - {"lm_head.weight"}  # the tied copy is left out
    worst = max(float(((weights[0] * clients[0][k].double() + weights[1] * clients[1][k].double()) / sum(weights)
                       - aggregate[k].double()).abs().max()) for k in aggregate)
    assert worst < 1e-6
    # The clients really differ (their updates are far above the tolerance), so the check can fail.
    assert max(float((clients[0][k] - clients[1][k]).abs().max()) for k in aggregate) > 1e-3


def test_each_rank_of_a_live_world_size_2_actor_holds_the_global_model_after_reload(reports: Reports) -> None:
    _, ranks, _ = reports
    for report in ranks:
        assert report["before_reload"]["max_abs_error"] > 1e-3  # client 0's own update, not yet the aggregate
        after = report["after_reload"]
        assert after["missing"] == [] and after["placements"] == ["(Shard(dim=0),)"]
        assert after["max_abs_error"] == 0.0, f"rank {report['rank']}: {after}"
        reload = report["reload"]
        assert reload["rank"] == report["rank"] and reload["actor"]["hooks_reset"] == ["client_rule"]


def test_fedprox_reports_from_every_rank_in_every_phase(reports: Reports) -> None:
    _, (rank0, rank1), _ = reports
    pids = {rank0["pid"], rank1["pid"]}
    for markers, ranks in ((rank0["client0_markers"], {"0", "1"}), (rank1["client1_markers"], {"0"}),
                           (rank0["reload_markers"], {"0", "1"})):
        assert {m["rank"] for m in markers} == ranks
        assert {m["pid"] for m in markers} <= pids and len(markers) == len(ranks)
        assert all(m["rules"] == [FEDPROX_RULE] and m["tensors"] > 0 for m in markers)


def test_the_round_reports_its_timings(reports: Reports) -> None:
    _, ranks, seconds = reports
    server = ranks[0]["server"]
    print(f"2-rank round: {seconds:.1f} s; per process, seconds at the end of each phase: "
          f"{[r['phase_s'] for r in ranks]}; CPU seconds {[r['cpu_s'] for r in ranks]}; "
          f"server: {server['aggregate_s']} s aggregate, {server['verify_s']} s verify")
    # Every rank timed every phase, in the order they ran (a hung collective is verl_world.run's
    # hang guard, not an assertion here).
    for report in ranks:
        laps = report["phase_s"]
        assert list(laps) == ["imports", "1 client 1", "2 client 0", "3 server", "4 reloaded"], laps
        assert list(laps.values()) == sorted(laps.values()) and report["cpu_s"] > 0
    assert server["aggregate_s"] >= 0 and server["verify_s"] >= 0
