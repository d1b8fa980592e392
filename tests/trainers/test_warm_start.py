"""``fedagent warm-start`` on the tiny model with the real SmolLM2 tokenizer: labels, learning,
output directory, refusals and determinism."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr import atomic
from fedagent_flwr.rollout import tokenize_conversation
from fedagent_flwr.trainers.common import warm_start as ws
from testkit.guess_conversations import CONVERSATIONS, conversation
from testkit.torch_state import deterministic_algorithms_restored


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "expert.jsonl", [{"messages": m, "reward": 1.0, "seed": i}
                                                   for i, m in enumerate(CONVERSATIONS)])


@pytest.fixture(autouse=True)
def _restore_deterministic_algorithms() -> Iterator[None]:
    """The command turns on torch's deterministic algorithms (process-wide); put them back."""
    yield from deterministic_algorithms_restored()


def run(*argv: Any) -> int:
    return ws.main([str(a) for a in argv])


def weights_digest(model_dir: Path) -> str:
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_labels_are_the_reply_tokens_only(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    prompt, response, mask = tokenize_conversation(tok, CONVERSATIONS[0])
    example = ws.make_example(1, prompt, response, mask)
    labelled = [i for i, label in enumerate(example.labels) if label != ws.IGNORE]
    assert labelled == [len(prompt) + j for j, m in enumerate(mask) if m]
    assert all(example.labels[i] == example.input_ids[i] for i in labelled)
    assert tok.decode([example.input_ids[i] for i in labelled], skip_special_tokens=True) == "".join(
        m["content"] for m in CONVERSATIONS[0] if m["role"] == "assistant")

    # other observation texts: more or fewer unlabelled tokens, the same labelled ones
    wordy = conversation([25, 12, 7], ["lower, much lower than that", "still lower"], first="A much longer task text.")
    other = ws.make_example(1, *tokenize_conversation(tok, wordy))
    assert len(other.input_ids) != len(example.input_ids)
    assert [t for t in other.labels if t != ws.IGNORE] == [t for t in example.labels if t != ws.IGNORE]


def mean_reply_nll(model: Any, examples: list[ws.Example], pad_id: int, device: Any, batch_size: int = 4) -> float:
    """Mean negative log-likelihood per reply token of ``examples`` under ``model`` (no gradients):
    the test's own measure of what training did, from the command's :func:`ws.collate` and
    :func:`ws.reply_loss`."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            loss, n = ws.reply_loss(model, *ws.collate(examples[start:start + batch_size], pad_id, device))
            total, count = total + float(loss), count + n
    model.train(was_training)
    return total / max(count, 1)


def test_training_lowers_the_reply_loss(smollm2_tokenizer: Any, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer
    examples, dropped = ws.build_examples(tok, list(enumerate(CONVERSATIONS, 1)), max_len=4096)
    assert (len(examples), dropped) == (2, 0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    cpu = torch.device("cpu")
    before = mean_reply_nll(model, examples, tok.pad_token_id, cpu)
    lines: list[str] = []
    stats = ws.train(model, examples, ws.TrainConfig(epochs=30, lr=3e-3, batch_size=2, log_every=10),
                     tok.pad_token_id, cpu, lines.append)
    after = mean_reply_nll(model, examples, tok.pad_token_id, cpu)
    assert stats.steps == 30 and len(lines) == 3 and lines[-1].startswith("step 30/30 epoch 30: loss ")
    assert "tokens/s" in lines[0]
    assert after < 0.5 * before, (before, after)
    assert stats.epoch_losses[-1] < 0.5 * stats.epoch_losses[0]
    assert stats.epoch_losses[0] == pytest.approx(before, rel=1e-4)  # one batch: step 1 scores the untrained model


def test_the_command_writes_a_loadable_model_with_its_record(tiny_model_dir: Path, data: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "warm"
    assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--epochs", 2, "--lr", 1e-3,
               "--batch-size", 1, "--device", "cpu", "--min-reward", 1.0, "--log-every", 2) == 0
    printed = capsys.readouterr().out
    assert "step 4/4 epoch 2" in printed and f"saved {out}" in printed
    record = json.loads((out / ws.RECORD_FILE).read_text())
    assert record["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert (record["examples_used"], record["examples_dropped_too_long"], record["steps"]) == (2, 0, 4)
    assert (record["epochs"], record["seed"], record["base_model"]) == (2, 0, str(tiny_model_dir.resolve()))
    assert record["loss_last_epoch"] < record["loss_first_epoch"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left

    assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--epochs", 1, "--device", "cpu") == 1
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--epochs", 1, "--device", "cpu",
               "--force") == 0
    assert json.loads((out / ws.RECORD_FILE).read_text())["steps"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expert.jsonl", "warm"]
    # --force replaces only an earlier warm start's output, never a folder of other things.
    (tmp_path / "models" / "other-model").mkdir(parents=True)
    (tmp_path / "models" / "other-model" / "model.safetensors").write_text("weights")
    assert run("--data", data, "--model", tiny_model_dir, "--out", tmp_path / "models", "--epochs", 1,
               "--device", "cpu", "--force") == 1
    assert "it is not an earlier warm start's output" in capsys.readouterr().err
    assert (tmp_path / "models" / "other-model" / "model.safetensors").read_text() == "weights"
    # ... nor a folder of run records that merely holds a copy of a warm start's record.
    (tmp_path / "records" / "eval.log").parent.mkdir()
    (tmp_path / "records" / "eval.log").write_text("log")
    shutil.copy(out / ws.RECORD_FILE, tmp_path / "records" / ws.RECORD_FILE)
    assert run("--data", data, "--model", tiny_model_dir, "--out", tmp_path / "records", "--epochs", 1,
               "--device", "cpu", "--force") == 1
    assert "it is not an earlier warm start's output" in capsys.readouterr().err
    assert (tmp_path / "records" / "eval.log").read_text() == "log"


def test_same_seed_same_weights(tiny_model_dir: Path, data: Path, tmp_path: Path) -> None:
    def orders(seed: int) -> list[list[int]]:
        examples = [ws.Example(i, [i], [i]) for i in range(2)]
        batches = ws.shuffled_batches
        generator = torch.Generator().manual_seed(seed)
        return [[e.line for b in batches(examples, 1, generator) for e in b] for _ in range(2)]

    assert orders(0) != orders(1)  # so seed 1 must give other weights
    digests = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert run("--data", data, "--model", tiny_model_dir, "--out", tmp_path / name, "--epochs", 2,
                   "--batch-size", 1, "--lr", 1e-3, "--seed", seed, "--device", "cpu") == 0
        digests.append(weights_digest(tmp_path / name))
    assert digests[0] == digests[1]
    assert digests[2] != digests[0]  # another seed, another batch order


def test_overlong_conversations_are_dropped_and_counted(smollm2_tokenizer: Any, tiny_model_dir: Path, data: Path,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "warm"
    lengths = sorted(len(p + r) for p, r, _ in (tokenize_conversation(smollm2_tokenizer, m) for m in CONVERSATIONS))
    assert lengths[0] < lengths[1]
    assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--epochs", 1, "--device", "cpu",
               "--max-len", lengths[0]) == 0
    assert f"dropped 1 of 2 conversations longer than --max-len {lengths[0]} tokens" in capsys.readouterr().out
    assert json.loads((out / ws.RECORD_FILE).read_text())["examples_dropped_too_long"] == 1


@pytest.mark.parametrize(("lines", "args", "error"), [
    (None, [], "does not exist"),
    ("dir", [], "expert.jsonl is a directory; give the JSONL file"),
    (b'{"messages": []}\n{"messages": "caf\xe9"}\n', [], "expert.jsonl:2: not UTF-8 (byte 0xe9)"),
    ([{"messages": CONVERSATIONS[0], "reward": 1}, '{"messages": [], "reward": NaN}'], ["--min-reward", "0.5"],
     "expert.jsonl:2: --min-reward is set but the line's 'reward' is nan, not a finite number"),
    (['{"messages": [], "reward": Infinity}'], ["--min-reward", "0.5"], "expert.jsonl:1: --min-reward is set but "
     "the line's 'reward' is inf, not a finite number"),
    ([{"messages": CONVERSATIONS[0], "mode": "windowed"}], [], "expert.jsonl:1: a windowed transcript must alternate"),
    ([{"messages": CONVERSATIONS[0][1:2] + CONVERSATIONS[0][2:3], "mode": "windowed"},
      {"messages": CONVERSATIONS[0][1:5], "mode": "windowed", "reward": 10.0}], [],
     "expert.jsonl:2: a windowed episode of 2 turns written whole on one line; re-write the file with the current "
     "`fedagent webshop-expert`, which writes a windowed episode one turn a line"),
    ([{"messages": CONVERSATIONS[0]}, "{not json"], [], "expert.jsonl:2: not JSON"),
    ([{"messages": CONVERSATIONS[0]}, "", {"text": "hi"}], [], "expert.jsonl:3: no 'messages' list"),
    ([{"messages": [{"role": "user", "content": 1}]}], [], "expert.jsonl:1: no 'messages' list"),
    ([{"messages": CONVERSATIONS[0], "reward": 1}, {"messages": CONVERSATIONS[1]}], ["--min-reward", "0.5"],
     "expert.jsonl:2: --min-reward is set but the line's 'reward' is missing, not a finite number"),
    ([{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[1][:2]}], [],
     "expert.jsonl:2: the conversation has no assistant message"),
    ([{"messages": CONVERSATIONS[0], "reward": 0.2}], ["--min-reward", "0.5"],
     "no conversation left to train on (0 after --min-reward, 0 too long)"),
    ([], [], "no conversation left to train on"),
])
def test_bad_input_is_refused_with_one_line(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            lines: Any, args: list[str], error: str) -> None:
    path = tmp_path / "expert.jsonl"
    if lines == "dir":
        path.mkdir()
    elif isinstance(lines, bytes):
        path.write_bytes(lines)
    elif lines is not None:
        write_jsonl(path, lines)
    assert run("--data", path, "--model", tiny_model_dir, "--out", tmp_path / "warm", "--device", "cpu", *args) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedagent warm-start: ") and error in err and err.count("\n") == 1
    assert not (tmp_path / "warm").exists()


def _tiny_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def test_reply_loss_is_transformers_own_shifted_loss(smollm2_tokenizer: Any, tiny_model_dir: Path) -> None:
    """Each reply token is scored from the positions before it: the same loss transformers computes
    from the labels (its own shift), and the same as a sum of -log p(token t | tokens < t) by hand."""
    tok = smollm2_tokenizer
    model = _tiny_model(tiny_model_dir)
    example = ws.make_example(1, *tokenize_conversation(tok, CONVERSATIONS[0]))
    ids, attention, labels = ws.collate([example], tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        loss_sum, count = ws.reply_loss(model, ids, attention, labels)
        hf = model(ids, attention_mask=attention, labels=labels).loss
        log_probs = torch.log_softmax(model(ids, attention_mask=attention).logits[0].float(), dim=-1)
    reply_positions = [t for t, label in enumerate(example.labels) if label != ws.IGNORE]
    assert count == len(reply_positions) and reply_positions[0] > 0
    by_hand = -sum(float(log_probs[t - 1, example.input_ids[t]]) for t in reply_positions)
    assert float(loss_sum) == pytest.approx(by_hand, rel=1e-5)
    assert float(loss_sum) / count == pytest.approx(float(hf), rel=1e-5)


def test_padding_adds_no_loss(smollm2_tokenizer: Any, tiny_model_dir: Path) -> None:
    """A right-padded batch scores exactly its examples run alone: padding carries no label."""
    tok = smollm2_tokenizer
    model = _tiny_model(tiny_model_dir)
    examples, _ = ws.build_examples(tok, list(enumerate(CONVERSATIONS, 1)), max_len=4096)
    assert len({len(e.input_ids) for e in examples}) == 2  # one of them is padded
    cpu = torch.device("cpu")
    with torch.no_grad():
        padded, padded_count = ws.reply_loss(model, *ws.collate(examples, tok.pad_token_id, cpu))
        alone = [ws.reply_loss(model, *ws.collate([e], tok.pad_token_id, cpu)) for e in examples]
    assert padded_count == sum(n for _, n in alone)
    assert float(padded) == pytest.approx(sum(float(loss) for loss, _ in alone), rel=1e-5)


def test_chat_template_errors_are_one_line_with_file_and_line(smollm2_tokenizer: Any) -> None:
    conversations = [(1, CONVERSATIONS[0]), (7, CONVERSATIONS[1])]
    raising = copy.deepcopy(smollm2_tokenizer)
    raising.chat_template = "{{ raise_exception('system messages are not supported') }}"
    with pytest.raises(ws.WarmStartError, match=r"^expert.jsonl:1: system messages are not supported$"):  # jinja
        ws.build_examples(raising, conversations, 4096, "expert.jsonl")
    missing = copy.deepcopy(smollm2_tokenizer)
    missing.chat_template = None
    with pytest.raises(ws.WarmStartError, match=r"^expert.jsonl:1: Cannot use chat template"):  # a ValueError
        ws.build_examples(missing, conversations, 4096, "expert.jsonl")


def test_a_base_model_without_chat_template_is_refused_up_front(tiny_model_dir: Path, data: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    assert run("--data", data, "--model", base, "--out", tmp_path / "warm", "--device", "cpu") == 1
    err = capsys.readouterr().err
    assert err == f"fedagent warm-start: the tokenizer in {base.resolve()} has no chat template\n"


def test_the_record_hashes_the_bytes_trained_on(tiny_model_dir: Path, data: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    trained_on = hashlib.sha256(data.read_bytes()).hexdigest()
    real_train = ws.train

    def train_then_replace_the_data(*args: Any, **kwargs: Any) -> Any:
        stats = real_train(*args, **kwargs)
        write_jsonl(data, [{"messages": CONVERSATIONS[1], "reward": 0.0}])  # replaced while training ran
        return stats

    monkeypatch.setattr(ws, "train", train_then_replace_the_data)
    assert run("--data", data, "--model", tiny_model_dir, "--out", tmp_path / "warm", "--epochs", 1,
               "--device", "cpu") == 0
    assert json.loads((tmp_path / "warm" / ws.RECORD_FILE).read_text())["data_sha256"] == trained_on


def test_output_is_fsynced_before_the_rename(tiny_model_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "warm"
    synced: list[Path] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst) == out:  # the final rename: every staged file and the staging directory are on disk
            staged = Path(src)
            assert {p for p in staged.rglob("*")} | {staged} <= set(synced), "renamed before fsync"
        real_replace(src, dst)

    monkeypatch.setattr(atomic, "fsync_file", lambda path: synced.append(Path(path)))
    monkeypatch.setattr(atomic, "fsync_dir", lambda path: synced.append(Path(path)))
    monkeypatch.setattr(atomic.os, "replace", replace)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    ws.save_output(model, AutoTokenizer.from_pretrained(str(tiny_model_dir)), {"steps": 1}, out)
    assert (out / "model.safetensors").is_file() and synced[-1] == tmp_path  # the parent after the rename


def _fail_the_final_rename(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the rename of the staged folder to ``out`` fail as on a full disk; other renames run."""
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst) == out and Path(src).name.startswith(f".{out.name}.tmp-"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)


def test_a_failed_final_rename_keeps_the_previous_output(tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "warm"
    out.mkdir()
    (out / ws.RECORD_FILE).write_text('{"steps": 7}')
    _fail_the_final_rename(out, monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with pytest.raises(OSError, match="No space left"):
        ws.save_output(model, AutoTokenizer.from_pretrained(str(tiny_model_dir)), {"steps": 1}, out)
    assert json.loads((out / ws.RECORD_FILE).read_text()) == {"steps": 7}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm"]  # no staging or aside left


def test_a_save_that_fails_after_training_is_one_line_and_keeps_the_previous_output(
        tiny_model_dir: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "warm"
    shutil.copytree(tiny_model_dir, out)  # an earlier output, which --force may replace
    (out / ws.RECORD_FILE).write_text('{"steps": 7}')
    _fail_the_final_rename(out, monkeypatch)
    assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--batch-size", 1, "--device", "cpu",
               "--min-reward", 1.0, "--force") == 1
    last = capsys.readouterr().err.splitlines()[-1]  # after transformers' progress bars
    assert last == (f"fedagent warm-start: --out {out}: saving the trained model failed (No space left on device); "
                    "the training is lost and anything at --out is as it was: free space or name another --out, "
                    "then run again")
    assert json.loads((out / ws.RECORD_FILE).read_text()) == {"steps": 7}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expert.jsonl", "warm"]  # no staging or aside left


def test_one_epoch_prints_its_first_and_last_step_loss(tiny_model_dir: Path, data: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    torch.use_deterministic_algorithms(False)
    assert run("--data", data, "--model", tiny_model_dir, "--out", tmp_path / "warm", "--epochs", 1,
               "--batch-size", 1, "--lr", 1e-3, "--device", "cpu") == 0
    record = json.loads((tmp_path / "warm" / ws.RECORD_FILE).read_text())
    assert record["loss_first_step"] != record["loss_last_step"] and not math.isnan(record["loss_last_step"])
    printed = capsys.readouterr().out
    assert f"step loss {record['loss_first_step']:.4f} -> {record['loss_last_step']:.4f} over 2 steps" in printed
    assert torch.are_deterministic_algorithms_enabled()  # --seed seeds everything (seed_everything), not only the RNGs


def test_a_warm_start_output_is_a_base_model_the_run_and_both_trainers_load(
        tiny_model_dir: Path, data: Path, tmp_path: Path, smollm2_tokenizer: Any) -> None:
    """The output directory as ``model.path``: the server's base-model check takes it, the evaluator
    and reference trainer load it (``evaluator.load_model``), verl's tokenizer loader renders the
    same chat template as the base model's tokenizer, and verl's windowed agent loop plays an
    episode with it. ``--save-dtype bfloat16`` writes half the bytes, every weight the fp32 one
    rounded once, and loads the same way."""
    import asyncio

    from safetensors import safe_open
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils import hf_tokenizer

    from fedagent_flwr.models.smollm2 import resolve_model_path
    from fedagent_flwr.rollout.episode import ChatRenderer
    from fedagent_flwr.serverapp import preflight
    from fedagent_flwr.trainers.common.evaluator import load_model
    from fedagent_flwr.trainers.verl.agent_loop import EnvAgentLoop
    from fedagent_flwr.trainers.verl.dataset import EnvEpisodeDataset
    from testkit.verl_agent_loop import HFServer, loop_config

    outs = {dtype: tmp_path / dtype for dtype in ws.SAVE_DTYPES}
    for dtype, out in outs.items():
        assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--epochs", 1, "--lr", 1e-3,
                   "--batch-size", 2, "--device", "cpu", "--save-dtype", dtype) == 0
        assert json.loads((out / ws.RECORD_FILE).read_text())["save_dtype"] == dtype
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        with safe_open(str(out / "model.safetensors"), "pt") as weights:
            assert {weights.get_tensor(k).dtype for k in weights.keys()} == {getattr(torch, dtype)}
    sizes = {d: (o / "model.safetensors").stat().st_size for d, o in outs.items()}
    assert sizes["bfloat16"] < 0.55 * sizes["float32"]

    window = [{"role": "user", "content": "Guess the secret integer in [1, 50]. Current observation: too low."}]
    base_ids = ChatRenderer(smollm2_tokenizer, None).prompt(window)[1]
    (full, _), (half, _) = (load_model(resolve_model_path(str(o)), 0) for o in outs.values())
    for name, param in full.state_dict().items():  # the same training, saved two ways
        assert torch.equal(half.state_dict()[name], param.to(torch.bfloat16).float()), name
    for out in outs.values():
        ref = preflight.base_model(resolve_model_path(str(out)), str(out))  # the server's check of model.path
        assert ref.path == str(out.resolve()) and ref.format == "hf-safetensors"
        model, tokenizer = load_model(resolve_model_path(str(out)), 0)  # evaluator and reference trainer
        assert model.dtype == torch.float32 and tokenizer.eos_token == "<|im_end|>"
        verl_tokenizer = hf_tokenizer(str(out))  # what verl's workers load from actor_rollout_ref.model.path
        assert ChatRenderer(verl_tokenizer, None).prompt(window)[1] == base_ids
        assert verl_tokenizer.eos_token_id == smollm2_tokenizer.eos_token_id == model.generation_config.eos_token_id
        cfg = loop_config(prompt_length=4096, response_length=16)
        loop = EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=HFServer(model.eval()),
                            tokenizer=verl_tokenizer, processor=None, dataset_cls=EnvEpisodeDataset,
                            data_config=DictConfigWrap(cfg.data), max_new_tokens=8, history_length=2)
        turns = asyncio.run(loop.run_windowed({"temperature": 0.0}, validate=False, env_name="TinyGuess",
                                              env_config={"lo": 1, "hi": 50}, seed=3, max_turns=2))
        assert len(turns) == 2 and all(t.num_turns == 1 and t.response_ids for t in turns)


@pytest.mark.parametrize(("choice", "enabled"), [
    ("math", {"math": True, "flash": False, "mem_efficient": False, "cudnn": False}),
    ("auto", None),  # torch's own flags, whatever they are, untouched
])
def test_attention_pins_the_kernels_training_may_use(tiny_model_dir: Path, data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, choice: str,
                                                     enabled: dict[str, bool] | None) -> None:
    def flags() -> dict[str, bool]:
        return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
                for name in ("math", "flash", "mem_efficient", "cudnn")}

    outside, seen = flags(), []
    real_train = ws.train

    def spying_train(*args: Any, **kwargs: Any) -> Any:
        seen.append(flags())  # what scaled-dot-product attention may use while the model trains
        return real_train(*args, **kwargs)

    monkeypatch.setattr(ws, "train", spying_train)
    out = tmp_path / "warm"
    assert run("--data", data, "--model", tiny_model_dir, "--out", out, "--epochs", 1, "--device", "cpu",
               "--attention", choice) == 0
    assert seen == [enabled or outside]
    assert flags() == outside  # put back after training
    assert json.loads((out / ws.RECORD_FILE).read_text())["attention"] == choice


def test_efficient_attention_on_the_cpu_is_refused_before_training(tiny_model_dir: Path, data: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--data", data, "--model", tiny_model_dir, "--out", tmp_path / "warm", "--epochs", 1,
               "--device", "cpu", "--attention", "efficient") == 1
    assert "--attention efficient needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "warm").exists()
