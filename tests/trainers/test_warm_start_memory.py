"""The warm start's memory options on the tiny model: the reply-only loss (output head only where the
loss needs it) gives the full-logits loss and gradients, gradient checkpointing trains the same
weights, and the command records both and the GPU memory cap."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fedagent_flwr.trainers.common import reply_loss as rl
from fedagent_flwr.trainers.common import warm_start as ws
from testkit.guess_conversations import CONVERSATIONS
from testkit.torch_state import deterministic_algorithms_restored


@pytest.fixture(autouse=True)
def _restore_deterministic_algorithms() -> Iterator[None]:
    """The command turns on torch's deterministic algorithms (process-wide); put them back."""
    yield from deterministic_algorithms_restored()


def load(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def examples(tokenizer: Any) -> list[ws.Example]:
    built, _ = ws.build_examples(tokenizer, list(enumerate(CONVERSATIONS, 1)), max_len=4096)
    assert len({len(e.input_ids) for e in built}) == 2  # one row of the batch is padded
    return built


def full_logits_reference(model: Any, ids: Any, attention: Any, labels: Any) -> Any:
    """The test's own statement of the loss: every position's logits, position t scoring token t+1,
    summed fp32 cross-entropy over the labelled tokens."""
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    total = torch.zeros((), dtype=torch.float32)
    for row in range(ids.shape[0]):
        log_probs = torch.log_softmax(logits[row], dim=-1)
        for t in range(1, ids.shape[1]):
            if labels[row, t] != ws.IGNORE:
                total = total - log_probs[t - 1, labels[row, t]]
    return total


def gradients(model: Any, loss: Any) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def test_reply_only_logits_give_the_full_logits_loss_and_gradients(smollm2_tokenizer: Any,
                                                                   tiny_model_dir: Path) -> None:
    model = load(tiny_model_dir).train()
    ids, attention, labels = ws.collate(examples(smollm2_tokenizer), smollm2_tokenizer.pad_token_id,
                                        torch.device("cpu"))
    head_rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _out: head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    loss, count = ws.reply_loss(model, ids, attention, labels)
    hook.remove()
    reply_tokens = int((labels[:, 1:] != ws.IGNORE).sum())
    assert count == reply_tokens and head_rows == [reply_tokens]  # the head ran on the reply positions only
    assert reply_tokens < 0.5 * ids.numel()

    reference = full_logits_reference(model, ids, attention, labels)
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    ours, theirs = gradients(model, loss), gradients(model, reference)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(model.parameters()))
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    full, full_count = ws.reply_loss(model, ids, attention, labels, reply_only=False)  # the fallback path
    assert full_count == count and float(full) == pytest.approx(float(reference), rel=1e-5)


def test_the_head_check_refuses_a_model_whose_logits_are_more_than_its_head(tiny_model_dir: Path) -> None:
    """Gemma-2 soft-caps its logits after the head: the reply-only loss would be another loss there,
    so the check that picks it says no (and the command computes full logits)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    ids = torch.tensor([[5, 17, 300, 41, 9, 2, 77, 8]])
    assert rl.head_matches_full_logits(load(tiny_model_dir), ids)
    config = Gemma2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(config)
    assert not rl.head_matches_full_logits(gemma, ids)
    config.final_logit_softcapping = None
    assert rl.head_matches_full_logits(Gemma2ForCausalLM(config), ids)


def decoder_layer_calls(model: Any) -> list[int]:
    """A list that grows by one each time the first decoder layer starts a forward pass (a pre-hook:
    checkpointing's recomputation stops early, once it has the tensors the backward pass needs, so
    a hook after the forward would not see it)."""
    calls: list[int] = []
    model.base_model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_gradient_checkpointing_recomputes_the_layers_and_trains_the_same_weights(smollm2_tokenizer: Any,
                                                                                    tiny_model_dir: Path) -> None:
    built = examples(smollm2_tokenizer)
    trained = {}
    for checkpointing in (False, True):
        model = load(tiny_model_dir)
        calls = decoder_layer_calls(model)
        config = ws.TrainConfig(epochs=2, lr=1e-3, batch_size=2, log_every=100, gradient_checkpointing=checkpointing)
        ws.train(model, built, config, smollm2_tokenizer.pad_token_id, torch.device("cpu"), lambda _: None)
        # one forward per step, plus its recomputation in the backward pass when checkpointing
        assert len(calls) == (4 if checkpointing else 2)
        assert not model.is_gradient_checkpointing  # left as it came
        trained[checkpointing] = model.state_dict()
    for name, weight in trained[False].items():
        torch.testing.assert_close(trained[True][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_the_command_records_checkpointing_and_the_memory_cap(tiny_model_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "expert.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    common = ["--data", data, "--model", tiny_model_dir, "--epochs", 1, "--device", "cpu"]
    assert ws.main([str(a) for a in [*common, "--out", tmp_path / "a", "--gradient-checkpointing"]]) == 0
    record = json.loads((tmp_path / "a" / ws.RECORD_FILE).read_text())
    assert (record["gradient_checkpointing"], record["reply_only_logits"]) == (True, True)
    assert (record["max_gpu_memory_fraction"], record["peak_gpu_memory_gib"]) == (None, None)
    capsys.readouterr()

    assert ws.main([str(a) for a in [*common, "--out", tmp_path / "b", "--max-gpu-memory-fraction", 0.3]]) == 1
    error = "fedagent warm-start: --max-gpu-memory-fraction 0.3 needs a CUDA device, not cpu\n"
    assert capsys.readouterr().err == error
    assert not (tmp_path / "b").exists()
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            ws.parse_args([str(a) for a in [*common, "--out", tmp_path / "c", "--max-gpu-memory-fraction", bad]])
    assert "must be in (0, 1]" in capsys.readouterr().err


def test_the_memory_cap_names_the_current_cuda_device_by_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device auto``/``cuda`` give ``torch.device("cuda")``, with no index, which
    ``set_per_process_memory_fraction`` refuses; the cap passes the current device's index. (No GPU
    here: torch.cuda's three calls are replaced by recorders; on a GPU the real ones run.)"""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.append(("cap", (fraction, device))))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: calls.append(("size", device)) or SimpleNamespace(total_memory=80 * 2**30))
    assert ws.apply_memory_cap(0.25, torch.device("cuda")) == 20 * 2**30
    assert ws.apply_memory_cap(0.5, torch.device("cuda", 1)) == 40 * 2**30
    assert calls == [("cap", (0.25, 3)), ("size", 3), ("cap", (0.5, 1)), ("size", 1)]
