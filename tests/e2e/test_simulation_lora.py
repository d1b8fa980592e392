"""End to end: federated LoRA (``model.lora.rank=4``) in a real Flower simulation, 2 clients and 2
rounds of the reference trainer on the tiny model. Each client uploads only peft's adapter files; the
server reads each adapter as the global model plus its update and averages those full models, so
the new global model changes only in the targeted weights and equals the mean of
``W + (alpha/r) B_i @ A_i`` recomputed here with plain torch from the files; the audit agrees.

The trainers run persistent (one per node for the run instead of one per job, ~4.5 s of CPU saved
on each of 8 jobs): ``tests/trainers/reference/test_lora.py`` shows that a persistent session trains
the adapters of fresh subprocesses bit for bit, and keeps the subprocess LoRA trainer covered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from testkit.audit import audit_run
from testkit.flower_harness import SuperLink
from testkit.lora_adapters import adapter_oracle
from testkit.run_end import ran_every_round
from testkit.simulation_runs import run_job

pytestmark = pytest.mark.slow

TARGETED = {f"model.layers.{layer}.self_attn.{module}.weight" for layer in (0, 1)
            for module in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_lora_clients_upload_adapters_and_the_server_averages_the_full_models(
        superlink: SuperLink, tmp_path: Path, tiny_model_dir: Path) -> None:
    summary, run_dir, output = run_job(
        superlink, tmp_path,
        f"model.path={tiny_model_dir} model.lora.rank=4 model.lora.alpha=8 num_rounds=2 eval.num_episodes=2 "
        "trainer.max_new_tokens=8 trainer.lr=1e-2 storage.keep_client_checkpoints=true trainer.mode=persistent",
        supernodes=2,
    )
    assert ran_every_round(summary), output[-4000:]  # "degraded" at most: the tiny model rarely scores
    previous = tiny_model_dir.resolve()
    for entry in summary["rounds"]:
        r = entry["round"]
        assert entry["client_actor_ids"] == [0, 1] and not entry["rejected"] and entry["started_from"] == str(previous)
        aggregate = Path(entry["aggregated_actor"]) / "model.safetensors"
        full_bytes = aggregate.stat().st_size
        oracles = []
        for c, uploaded in zip((0, 1), entry["client_actors"]):
            job = json.loads((run_dir / f"round_{r}" / f"client_{c}" / "train_job.json").read_text())
            assert job["model_path"] == str(previous) and job["trainer"]["lora"]["rank"] == 4
            # the upload is the adapter alone, a small fraction of the full model's bytes
            files = {p.name: p.stat().st_size for p in Path(uploaded).iterdir()}
            assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"], files
            ratio = sum(files.values()) / full_bytes
            print(f"round {r} client {c}: uploaded {files} = {sum(files.values())} bytes, "
                  f"{ratio:.4%} of the global model's {full_bytes}")
            assert ratio < 0.01
            oracles.append(adapter_oracle(previous, Path(uploaded)))
        with safe_open(str(aggregate), framework="pt") as handle:
            sources = json.loads(handle.metadata()["fedagent.sources"])
        assert [s["path"] for s in sources] == entry["client_actors"]
        assert all(s["base"] == str(previous) for s in sources)  # each adapter read on this round's start
        weights = [float(s["weight"]) for s in sources]
        start, written = load_file(str(previous / "model.safetensors")), load_file(str(aggregate))
        assert set(written) == set(start)
        # changed only where the adapters were attached, and there as the mean of the clients' full models
        assert {key for key in start if not torch.equal(written[key], start[key])} == TARGETED
        assert all(oracle[1] == TARGETED for oracle in oracles)
        worst = 0.0
        for key, value in written.items():
            expected = sum(w * oracle[0][key] for w, oracle in zip(weights, oracles))
            worst = max(worst, (value.double() - expected).abs().max().item())
        print(f"round {r}: max |aggregate - mean(W + s B_i A_i)| = {worst:.3e} (weights {weights})")
        assert worst < 1e-6
        previous = Path(entry["aggregated_actor"])
    assert summary["final_model"] == str(previous)
    audit = audit_run(run_dir)
    assert audit.returncode == 0 and audit.stdout.count(" ok") == 2, audit.stdout + audit.stderr
