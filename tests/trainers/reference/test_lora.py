"""Federated LoRA in the reference trainer: a client-round attaches a fresh, seeded adapter to the
global model, trains only it and writes only peft's adapter files, which the server reads as the
global model plus the adapter's update; the persistent session gives the subprocess's adapter bit for
bit and keeps its live model free of adapter layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedagent_flwr.checkpoint import CheckpointRef, open_checkpoint
from fedagent_flwr.clientapp.job import TrainJob, TrainResult, load
from fedagent_flwr.models.tiny import make_tiny_model
from fedagent_flwr.schema.lora import Lora
from fedagent_flwr.trainers.common.seeds import derive_seed
from fedagent_flwr.trainers.reference.lora import adapter_seed, attach_adapter
from fedagent_flwr.trainers.reference.session import ReferenceSession
from testkit.reference_trainer import run_trainer, train_job

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}
FACTORS = {f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{factor}.weight"
           for layer in (0, 1) for module in ("q_proj", "k_proj", "v_proj", "o_proj") for factor in "AB"}


def _trainer(**extra: object) -> dict:
    from testkit.reference_trainer import TRAINER

    return {**TRAINER, "lora": dict(LORA), **extra}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, TrainResult]:
    """One LoRA client-round in a fresh trainer process (client 1 of round 1, two optimiser passes)."""
    tmp = tmp_path_factory.mktemp("lora")
    proc = run_trainer("train", train_job(tmp, tiny_model_dir, "a", trainer=_trainer()))
    assert proc.returncode == 0, proc.stderr
    return tmp, load(TrainResult, tmp / "a" / "train_result.json")


def test_a_client_round_writes_only_the_adapter_and_the_server_reads_it_as_a_full_model(
        trained: tuple[Path, TrainResult], tiny_model_dir: Path) -> None:
    tmp, result = trained
    actor = Path(result.actor_dir)
    assert result.actor_format == "peft-lora" and actor == (tmp / "a" / "checkpoints" / "global_step_1" / "actor")
    assert sorted(p.name for p in actor.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    settings = json.loads((actor / "adapter_config.json").read_text())
    assert [settings[k] for k in ("peft_type", "r", "lora_alpha", "lora_dropout")] == ["LORA", 4, 8, 0.0]
    assert sorted(settings["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    factors = load_file(str(actor / "adapter_model.safetensors"))
    assert set(factors) == FACTORS and all(v.dtype == torch.float32 for v in factors.values())
    # the model it was trained on, by content hash: the server reads the adapter on that model only
    with safe_open(str(actor / "adapter_model.safetensors"), framework="pt") as handle:
        assert handle.metadata()["fedagent.base_sha256"] == CheckpointRef.for_directory(tiny_model_dir).sha256
    assert all(factors[k].abs().max() > 0 for k in FACTORS if "lora_B" in k)  # training moved B off zero
    # a few percent of the full model's bytes (the tiny model is mostly its 49k-token embedding)
    ratio = (actor / "adapter_model.safetensors").stat().st_size / (tiny_model_dir / "model.safetensors").stat().st_size
    assert ratio < 0.01, ratio
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    ref = CheckpointRef.for_directory(actor)
    assert ref.format == "peft-lora"
    with open_checkpoint(ref, root=tmp, base=CheckpointRef.for_directory(tiny_model_dir)) as reader:
        changed = {key for key in base if not torch.equal(reader.read(key), base[key])}
    assert changed == {k.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                       for k in FACTORS if "lora_A" in k}


def test_the_fresh_adapter_is_seeded_by_run_round_and_client_without_touching_other_streams(
        tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert adapter_seed(42, 3, 1) == derive_seed("lora-init", 42, 3, 1)  # sha256, the same in every process

    def fresh(seed: int) -> dict[str, torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        before = torch.get_rng_state()
        peft_model = attach_adapter(model, Lora(**LORA), seed)  # type: ignore[arg-type]
        assert torch.equal(torch.get_rng_state(), before)  # sampling and dropout streams untouched
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            n for n in (n for n, _ in model.named_parameters()) if ".lora_" in n]
        assert peft_model.base_model.model is model  # the GRPO code trains the same HF model object
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}

    first, again, other = fresh(adapter_seed(42, 1, 0)), fresh(adapter_seed(42, 1, 0)), fresh(adapter_seed(42, 1, 1))
    for name in first:
        assert torch.equal(first[name], again[name])
        if ".lora_B." in name:
            assert not first[name].any()  # B starts at zero: the adapted model starts as the global model
        else:
            assert not torch.equal(first[name], other[name])


def test_the_fresh_adapter_seeds_the_cpu_generator_only_and_gives_it_back(tiny_model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference trainer runs on the CPU: on a GPU node the adapter must not start CUDA (no
    CUDA generator is forked or reseeded), and the CPU stream continues as without the adapter."""
    from transformers import AutoModelForCausalLM

    touched: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node, as far as it can tell
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: touched.append("manual_seed_all"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: touched.append("get_rng_state"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    touched.clear()  # manual_seed itself reseeds the CUDA generators: only the adapter's calls count
    attach_adapter(model, Lora(**LORA), 7)  # type: ignore[arg-type]
    assert touched == []
    assert torch.equal(torch.rand(3), expected)


def test_the_adapter_comes_off_unmerged_leaving_the_model_as_it_was(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from fedagent_flwr.trainers.reference.lora import fresh_adapter

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    layout = [(name, type(module)) for name, module in model.named_modules()]
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    model.lm_head.weight.requires_grad_(False)  # whatever the flags were, they come back
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match="mid-round"), fresh_adapter(model, Lora(**LORA), 3) as peft_model:  # type: ignore[arg-type]
        assert peft_model.base_model.model is model and any("lora_A" in n for n, _ in model.named_parameters())
        with torch.no_grad():  # what training does to the factors; B != 0 would show in a merge
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.fill_(0.5)
        raise RuntimeError("a job that fails mid-round")
    assert [(name, type(module)) for name, module in model.named_modules()] == layout
    assert not hasattr(model, "peft_config")
    assert [p.requires_grad for p in model.parameters()] == flags
    state = model.state_dict()
    assert set(state) == set(weights) and all(torch.equal(state[k], weights[k]) for k in weights)  # not merged


def test_a_target_that_matches_nothing_exits_2_naming_the_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    trainer = _trainer()
    trainer["lora"]["target_modules"] = ["nope_proj"]
    proc = run_trainer("train", train_job(tmp_path, tiny_model_dir, "bad", trainer=trainer))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("reference_trainer: error: model.lora.target_modules = ['nope_proj']: ")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_persistent_session_trains_the_same_adapter_and_keeps_its_model_plain(
        trained: tuple[Path, TrainResult], tiny_model_dir: Path, smollm2_tokenizer_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fedagent_flwr.trainers.reference import lora

    _, subprocess_result = trained
    job = load(TrainJob, train_job(tmp_path, tiny_model_dir, "s", trainer=_trainer()))
    session = ReferenceSession()
    onto_live_model: list[bool] = []
    attach = lora.attach_adapter

    def spy(model: object, settings: Lora, seed: int) -> object:
        onto_live_model.append(model is session.cache.model)
        return attach(model, settings, seed)

    monkeypatch.setattr(lora, "attach_adapter", spy)
    result = session.train(job)
    assert onto_live_model == [True]  # no copy of the whole model per round
    expected = load_file(str(Path(subprocess_result.actor_dir) / "adapter_model.safetensors"))
    got = load_file(str(Path(result.actor_dir) / "adapter_model.safetensors"))
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    # the live model holds no adapter layers: the next round's global model loads into it by weights alone
    assert not [k for k in session.cache.model.state_dict() if "lora_" in k or "base_layer" in k]
    assert all(p.requires_grad for p in session.cache.model.parameters())  # as loaded
    global2 = make_tiny_model(tmp_path / "global2", seed=1, tokenizer_dir=smollm2_tokenizer_dir)
    second = session.train(load(TrainJob, train_job(tmp_path, global2, "s2", trainer=_trainer(), round=2)))
    assert session.cache.reloads == 1 and second.actor_format == "peft-lora"
    # the live model that carried round 1's adapter trains round 2's as a fresh process does, bit for bit
    proc = run_trainer("train", train_job(tmp_path, global2, "p2", trainer=_trainer(), round=2))
    assert proc.returncode == 0, proc.stderr
    fresh = load_file(str(tmp_path / "p2" / "checkpoints" / "global_step_1" / "actor" / "adapter_model.safetensors"))
    got = load_file(str(Path(second.actor_dir) / "adapter_model.safetensors"))
    assert set(got) == set(fresh) and all(torch.equal(got[k], fresh[k]) for k in fresh)


def test_per_client_validation_scores_the_adapter_merged_onto_the_model_it_was_trained_on(
        trained: tuple[Path, TrainResult], tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from fedagent_flwr.clientapp.client_val import trained_model_dir
    from testkit.lora_adapters import adapter_oracle

    _, result = trained
    merged = trained_model_dir(result, tiny_model_dir, tmp_path / "client_val" / "model", tiny_model_dir)
    assert merged == tmp_path / "client_val" / "model"
    oracle, changed = adapter_oracle(tiny_model_dir, Path(result.actor_dir))
    written = load_file(str(merged / "model.safetensors"))
    assert set(written) == set(oracle) and len(changed) == 8
    for key, value in written.items():
        torch.testing.assert_close(value.double(), oracle[key], rtol=1e-6, atol=1e-7)
    AutoModelForCausalLM.from_pretrained(str(merged))  # what the evaluator loads
