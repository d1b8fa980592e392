"""A peft LoRA adapter reads as the full model it stands for (W + alpha/r B @ A on the targeted
weights, W elsewhere), checked against a plain-torch oracle from the files and against peft's own
merge; a broken adapter is refused naming its file and key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef, LoraAdapterReader, open_checkpoint, weighted_mean
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint
from testkit.lora_adapters import adapter_oracle, base_state, write_adapter

TIED = ModelSpec("llama_tied_lora", "llama", seed=21, tie=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run root holding a tied tiny Llama (the global model) and two adapters of it."""
    root = tmp_path_factory.mktemp("lora")
    write_hf_checkpoint(TIED, root / "global")
    write_adapter(root / "global", root / "client_0", seed=1)
    write_adapter(root / "global", root / "client_1", seed=2)
    return root


def _open(root: Path, adapter: Path) -> LoraAdapterReader:
    reader = open_checkpoint(CheckpointRef.for_directory(adapter), root=root,
                             base=CheckpointRef.for_directory(root / "global"))
    assert isinstance(reader, LoraAdapterReader)
    return reader


def _broken(root: Path, tmp_path: Path, edit: dict[str, str | None]) -> Path:
    """A copy of client 0's adapter whose factors are renamed (``old -> new``) or dropped (``-> None``)."""
    copy = tmp_path / "broken"
    shutil.copytree(root / "client_0", copy)
    factors = load_file(str(copy / "adapter_model.safetensors"))
    for old, new in edit.items():
        value = factors.pop(old)
        if new is not None:
            factors[new] = value
    save_file(factors, str(copy / "adapter_model.safetensors"), metadata={"format": "pt"})
    return copy


def test_adapter_reads_as_the_oracle_full_model_and_as_peft_merges_it(root: Path) -> None:
    oracle, changed = adapter_oracle(root / "global", root / "client_0")
    base = base_state(root / "global")
    # every q/k/v/o projection of both layers, under the global model's own names
    assert changed == {f"model.layers.{i}.self_attn.{m}.weight" for i in range(2)
                       for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    with _open(root, root / "client_0") as reader:
        assert reader.ref.format == "peft-lora" and reader.base_ref is not None
        assert reader.scale == 2.0  # lora_alpha 8 / r 4
        assert sorted(reader.targets) == sorted(changed)
        assert reader.keys() == list(base)  # the global model's keys: tied lm_head left out as in its file
        for key in base:
            got = reader.read(key)
            assert got.dtype == torch.float32 and reader.shape(key) == tuple(base[key].shape)
            if key in changed:
                torch.testing.assert_close(got.double(), oracle[key], rtol=1e-6, atol=1e-7)
                assert not torch.equal(got, base[key])
                # rows read alone are the same rows
                torch.testing.assert_close(reader.read_rows(key, 3, 9), got[3:9], rtol=0, atol=1e-7)
            else:
                assert torch.equal(got, base[key]), key  # untouched, bit for bit
        assert reader.bytes_read > 0
    # peft's own merge of the same files (its key mapping and scaling) gives the same model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(root / "global")),
                                       str(root / "client_0")).merge_and_unload().state_dict()
    for key in changed:
        torch.testing.assert_close(merged[key].double(), oracle[key], rtol=1e-6, atol=1e-7)


def test_an_rslora_adapter_reads_with_alpha_over_sqrt_r_as_peft_merges_it(root: Path, tmp_path: Path) -> None:
    adapter = write_adapter(root / "global", tmp_path / "rslora", seed=5, rank=4, alpha=8.0, use_rslora=True)
    oracle, changed = adapter_oracle(root / "global", adapter)
    with open_checkpoint(CheckpointRef.for_directory(adapter), root=tmp_path,
                         base=CheckpointRef.for_directory(root / "global")) as reader:
        assert reader.scale == 4.0  # 8 / sqrt(4), not 8 / 4
        for key in changed:
            torch.testing.assert_close(reader.read(key).double(), oracle[key], rtol=1e-6, atol=1e-7)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(root / "global")),
                                       str(adapter)).merge_and_unload().state_dict()
    for key in changed:
        torch.testing.assert_close(merged[key].double(), oracle[key], rtol=1e-6, atol=1e-7)


def test_fedavg_of_adapters_is_the_exact_mean_of_the_full_updates(root: Path, tmp_path: Path) -> None:
    readers = [_open(root, root / f"client_{c}") for c in (0, 1)]
    with readers[0], readers[1]:
        report = weighted_mean([(readers[0], 1.0), (readers[1], 3.0)], tmp_path / "mean",
                               reference=open_checkpoint(CheckpointRef.for_directory(root / "global")))
    written = load_file(str(tmp_path / "mean" / "model.safetensors"))
    oracles = [adapter_oracle(root / "global", root / f"client_{c}")[0] for c in (0, 1)]
    base = base_state(root / "global")
    assert set(written) == set(base)
    for key, value in written.items():
        torch.testing.assert_close(value.double(), 0.25 * oracles[0][key] + 0.75 * oracles[1][key],
                                   rtol=1e-6, atol=1e-7)
    # FedIT's average of the factors (mean B times mean A) is not this mean
    f0, f1 = (load_file(str(root / f"client_{c}" / "adapter_model.safetensors")) for c in (0, 1))
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b_key = a_key.replace("lora_A", "lora_B")
    fedit = base["model.layers.0.self_attn.q_proj.weight"].double() + 2.0 * (
        (0.25 * f0[b_key] + 0.75 * f1[b_key]).double() @ (0.25 * f0[a_key] + 0.75 * f1[a_key]).double())
    assert (written["model.layers.0.self_attn.q_proj.weight"].double() - fedit).abs().max() > 1e-4
    # the header records each adapter's base, for the audit
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mean" / "model.safetensors"), framework="pt") as handle:
        sources = json.loads(handle.metadata()["fedagent.sources"])
    assert [s["base"] for s in sources] == [str((root / "global").resolve())] * 2
    assert all(s["base_sha256"] == CheckpointRef.for_directory(root / "global").sha256 for s in sources)
    assert report.update_stats is not None and report.update_stats.num_params == sum(v.numel() for v in base.values())


def test_format_detection_and_hash_cover_both_adapter_files(root: Path, tmp_path: Path) -> None:
    ref = CheckpointRef.for_directory(root / "client_0")
    assert (ref.format, ref.world_size) == ("peft-lora", 1)
    copy = tmp_path / "copy"
    shutil.copytree(root / "client_0", copy)
    settings = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**settings, "lora_alpha": 16}))
    moved = CheckpointRef(path=str(copy), format="peft-lora", sha256=ref.sha256)
    with pytest.raises(CheckpointError, match="content hash"):
        open_checkpoint(moved, root=tmp_path, base=CheckpointRef.for_directory(root / "global"))


def test_an_adapter_is_read_only_on_the_model_it_records_it_was_trained_on(root: Path, tmp_path: Path) -> None:
    """Same keys and shapes, another model (last round's, another run's): the factors would read as some
    other model without complaint; the adapter's recorded base hash refuses it, naming both hashes."""
    from testkit.lora_adapters import record_base

    other = shutil.copytree(root / "global", tmp_path / "other")
    state = load_file(str(other / "model.safetensors"))
    state["model.norm.weight"] += 1.0
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    trained_on, other_hash = (CheckpointRef.for_directory(d).sha256 for d in (root / "global", other))
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(CheckpointRef.for_directory(root / "client_0"), root=root,
                        base=CheckpointRef.for_directory(other))
    assert str(caught.value) == (
        f"{root / 'client_0' / 'adapter_model.safetensors'} was trained on the model with content hash {trained_on}, "
        f"and is read on {other}, whose content hash is {other_hash}: not the model it was trained on")
    # a base reference without a hash (per-client validation's): the directory is hashed
    with pytest.raises(CheckpointError, match="not the model it was trained on"):
        open_checkpoint(CheckpointRef.for_directory(root / "client_0"), root=root, base=CheckpointRef(str(other)))
    with open_checkpoint(CheckpointRef.for_directory(root / "client_0"), root=root,
                         base=CheckpointRef(str(root / "global"))) as reader:
        assert len(reader.targets) == 8
    # an adapter that records no base (peft's save_pretrained alone): nothing ties it to a model
    bare = shutil.copytree(root / "client_0", tmp_path / "bare")
    record_base(bare, None)
    with pytest.raises(CheckpointError, match=r"records no content hash of the model it was trained on \(safetensors "
                       r"metadata 'fedagent\.base_sha256'\)") as caught:
        open_checkpoint(CheckpointRef.for_directory(bare), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))
    assert str(bare / "adapter_model.safetensors") in str(caught.value)


def test_a_full_model_that_ships_an_adapter_config_is_a_full_model(root: Path, tmp_path: Path) -> None:
    """Some Hub repositories hold the merged weights and the adapter's settings (and weights) side by side:
    they are full models to the store. As a run's base model such a directory is refused: with peft
    installed, transformers' from_pretrained would load the adapter on top on every client while the
    server aggregates the weights alone."""
    from fedagent_flwr.config import ConfigError
    from fedagent_flwr.serverapp.preflight import base_model

    merged = shutil.copytree(root / "global", tmp_path / "merged")
    shutil.copy(root / "client_0" / "adapter_config.json", merged)
    assert CheckpointRef.for_directory(merged).format == "hf-safetensors"
    shutil.copy(root / "client_0" / "adapter_model.safetensors", merged)
    assert CheckpointRef.for_directory(merged).format == "hf-safetensors"
    assert CheckpointRef.for_directory(merged, fmt="hf-safetensors").sha256
    with pytest.raises(ConfigError, match=r"^config key 'model.path' = .*merged holds adapter_config.json, so the "
                       r"clients' trainers would load that adapter"):
        base_model(merged, str(merged))
    assert base_model(root / "global", str(root / "global")).format == "hf-safetensors"
    # an adapter alone stays an adapter, and is no base model
    assert CheckpointRef.for_directory(root / "client_0").format == "peft-lora"
    with pytest.raises(CheckpointError, match="holds no \\*.safetensors file but peft's adapter_model.safetensors: an "
                       "adapter is not a full model"):
        CheckpointRef.for_directory(root / "client_0", fmt="hf-safetensors")


def test_an_adapter_without_its_base_is_refused(root: Path) -> None:
    with pytest.raises(CheckpointError, match=r"client_0 is a LoRA adapter: .* none was given"):
        open_checkpoint(CheckpointRef.for_directory(root / "client_0"), root=root)


@pytest.mark.parametrize(("edit", "message"), [
    ({"base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight": None},
     r"'base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_A\.weight' has no partner "
     r"'base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_B\.weight'"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
      "base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight",
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
      "base_model.model.model.layers.0.self_attn.x_proj.lora_B.weight"},
     r"x_proj\.lora_A\.weight' updates 'model\.layers\.0\.self_attn\.x_proj\.weight', which the global model"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
      "base_model.model.model.layers.0.self_attn.q_proj.weight"},
     r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.weight' is not a LoRA factor"),
])
def test_a_missing_or_foreign_adapter_key_is_refused_naming_file_and_key(
        root: Path, tmp_path: Path, edit: dict[str, str | None], message: str) -> None:
    broken = _broken(root, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as caught:
        open_checkpoint(CheckpointRef.for_directory(broken), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))
    assert str(broken / "adapter_model.safetensors") in str(caught.value)


def _base_with(root: Path, tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the global model whose weight file also holds ``extra``."""
    base = shutil.copytree(root / "global", tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    save_file({**state, **extra}, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


def _adapter_with(root: Path, tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of client 0's adapter whose file also holds ``extra``."""
    copy = shutil.copytree(root / "client_0", tmp_path / "adapter")
    factors = load_file(str(copy / "adapter_model.safetensors"))
    save_file({**factors, **extra}, str(copy / "adapter_model.safetensors"), metadata={"format": "pt"})
    return copy


def test_a_second_pair_of_factors_for_the_same_weight_is_refused(root: Path, tmp_path: Path) -> None:
    # the same module with and without peft's prefix: both read as model.layers.0.self_attn.q_proj.weight
    module = "model.layers.0.self_attn.q_proj"
    adapter = _adapter_with(root, tmp_path, {f"{module}.lora_A.weight": torch.ones(4, 64),
                                             f"{module}.lora_B.weight": torch.ones(64, 4)})
    with pytest.raises(CheckpointError, match=rf"both update '{module}\.weight': one pair of factors per weight"):
        open_checkpoint(CheckpointRef.for_directory(adapter), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))


def test_an_adapter_of_a_tied_weight_is_refused(root: Path, tmp_path: Path) -> None:
    """A tied model whose file holds the head as well as the embedding: an update of the head alone
    would be undone (or spread to the embedding) when the model is tied again on load."""
    embedding = load_file(str(root / "global" / "model.safetensors"))["model.embed_tokens.weight"]
    base = _base_with(root, tmp_path, {"lm_head.weight": embedding.clone()})
    vocab, hidden = embedding.shape
    adapter = _adapter_with(root, tmp_path, {"base_model.model.lm_head.lora_A.weight": torch.ones(4, hidden),
                                             "base_model.model.lm_head.lora_B.weight": torch.ones(vocab, 4)})
    with pytest.raises(CheckpointError, match=r"updates 'lm_head\.weight', which the global model .* ties to "
                       r"'model\.embed_tokens\.weight'") as caught:
        open_checkpoint(CheckpointRef.for_directory(adapter), root=tmp_path, base=CheckpointRef.for_directory(base))
    assert str(adapter / "adapter_model.safetensors") in str(caught.value)


def test_factors_of_a_weight_that_is_not_a_matrix_are_refused(root: Path, tmp_path: Path) -> None:
    base = _base_with(root, tmp_path, {"model.scale.weight": torch.tensor(1.0)})  # a 0-d tensor
    adapter = _adapter_with(root, tmp_path, {"base_model.model.model.scale.lora_A.weight": torch.ones(4, 1),
                                             "base_model.model.model.scale.lora_B.weight": torch.ones(1, 4)})
    with pytest.raises(CheckpointError, match=r"updates 'model\.scale\.weight' \(\) of the global model, which is "
                       "not a 2-d weight"):
        open_checkpoint(CheckpointRef.for_directory(adapter), root=tmp_path, base=CheckpointRef.for_directory(base))


def test_factors_of_another_shape_are_refused(root: Path, tmp_path: Path) -> None:
    # an adapter of rank 4 whose config says rank 2: the factors do not fit the rank
    copy = tmp_path / "rank"
    shutil.copytree(root / "client_0", copy)
    settings = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**settings, "r": 2}))
    with pytest.raises(CheckpointError, match=r"rank"
                       r" 2 \(expected \(2, 64\) and \(\d+, 2\)\)") as caught:
        open_checkpoint(CheckpointRef.for_directory(copy), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))
    assert str(copy / "adapter_model.safetensors") in str(caught.value)
    # an adapter of another model (hidden size 32) on this global model
    other = ModelSpec("llama_small", "llama", seed=5, tie=True, overrides=(("hidden_size", 32),))
    write_hf_checkpoint(other, tmp_path / "small")
    write_adapter(tmp_path / "small", tmp_path / "small_adapter", seed=3)
    with pytest.raises(CheckpointError, match=r"do not fit 'model\.layers\.\d\.self_attn\.\w_proj\.weight'"):
        open_checkpoint(CheckpointRef.for_directory(tmp_path / "small_adapter"), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))


@pytest.mark.parametrize(("setting", "value"), [
    ("use_dora", True), ("fan_in_fan_out", True), ("modules_to_save", ["lm_head"]), ("peft_type", "IA3"),
    # initialisations that rewrite the base weight when the adapter is made (the model is W - s B0 A0 + s B A)
    ("init_lora_weights", "pissa"), ("init_lora_weights", "pissa_niter_4"), ("init_lora_weights", "olora"),
    ("init_lora_weights", "corda"), ("init_lora_weights", "loftq"), ("init_lora_weights", "lora_ga"),
    # an adapter applied only from its invocation tokens on (aLoRA), or routed between experts (Arrow)
    ("alora_invocation_tokens", [50, 51]), ("arrow_config", {"top_k": 2}),
])
def test_adapter_settings_the_reader_cannot_honour_are_refused(root: Path, tmp_path: Path, setting: str,
                                                                value: object) -> None:
    copy = tmp_path / "settings"
    shutil.copytree(root / "client_0", copy)
    settings = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**settings, setting: value}))
    with pytest.raises(CheckpointError, match=rf"adapter_config\.json: '?{setting}'? ") as caught:
        open_checkpoint(CheckpointRef.for_directory(copy), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))
    assert str(copy / "adapter_config.json") in str(caught.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_initialisations_that_leave_the_base_weight_alone_are_read(root: Path, tmp_path: Path, init: object) -> None:
    copy = tmp_path / "init"
    shutil.copytree(root / "client_0", copy)
    settings = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**settings, "init_lora_weights": init}))
    with open_checkpoint(CheckpointRef.for_directory(copy), root=tmp_path,
                         base=CheckpointRef.for_directory(root / "global")) as reader:
        assert isinstance(reader, LoraAdapterReader) and len(reader.targets) == 8


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted-digests", "hashed-at-opening"])
def test_an_adapter_file_checked_at_opening_and_changed_while_read_is_refused(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trusted: bool) -> None:
    """Digests taken on trust at opening (the audit's own, a store's receipts), or the files hashed there
    (the shared-fs aggregation's): the adapter's files are checked again once read, as any checkpoint's
    are (hashed at opening: not before stop 54, when one rewritten after its hash was read unnoticed)."""
    from fedagent_flwr.checkpoint import audit_digests
    from fedagent_flwr.checkpoint.audit_digests import AuditDigests
    from testkit.file_change import flip_byte

    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # the adapter was written a moment ago
    adapter = shutil.copytree(root / "client_0", tmp_path / "adapter")
    digests = AuditDigests() if trusted else None
    ref = (CheckpointRef.for_directory(adapter, hasher=digests.directory_hash) if digests is not None
           else CheckpointRef.for_directory(adapter))
    base = CheckpointRef.for_directory(root / "global")
    with open_checkpoint(ref, root=tmp_path, receipts=digests, base=base, check_hash="while-reading") as reader:
        assert isinstance(reader, LoraAdapterReader)
        reader.read(reader.targets[0])
        reader.verify_content()  # unchanged: passes
        flip_byte(adapter / "adapter_model.safetensors", restore_mtime=True, at=-1)  # only its ctime moves
        with pytest.raises(CheckpointError, match=f"{adapter / 'adapter_model.safetensors'} changed while it was read"):
            reader.verify_content()


def test_an_adapter_travels_through_the_http_store_and_opens_from_its_receipt(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Across machines (storage.kind=http) the upload is the adapter's files; the server's copy keeps the
    format and opens with its digests taken from the store's receipt: none of its bytes is hashed again,
    and both files are watched for a change while they are read (the base's too, its digests those the
    round's first adapter left: the strategy's, :func:`.sources.round_sources`)."""
    from fedagent_flwr.checkpoint import audit_digests
    from fedagent_flwr.checkpoint.audit_digests import AuditDigests
    from fedagent_flwr.checkpoint.http_server import HttpServerStore
    from fedagent_flwr.checkpoint.store import StorageSettings
    from testkit.store_harness import RUN, HashCounter, node

    (tmp_path / "run").mkdir()
    with HttpServerStore(StorageSettings(kind="http"), tmp_path / "run", RUN) as store:
        sent = node(store, tmp_path / "node0").put(root / "client_0", "actor", 1, 0)
        assert sent.format == "peft-lora"
        ref = store.resolve(sent, 1, 0)
        # what peft's save_pretrained wrote (its model card too), no more
        assert ref.format == "peft-lora" and sorted(p.name for p in Path(ref.path).iterdir()) == sorted(
            p.name for p in (root / "client_0").iterdir())
        oracle, changed = adapter_oracle(root / "global", root / "client_0")
        base = CheckpointRef.for_directory(root / "global")
        monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # the global model was written a moment ago
        base_digests = AuditDigests()
        base_digests.directory_hash(root / "global")
        hashed = HashCounter().install(monkeypatch)
        with open_checkpoint(ref, root=store.run_root, check_hash="while-reading", receipts=store.receipt_check(),
                             base=base, base_digests=base_digests) as reader:
            assert hashed.bytes < 1024, hashed.bytes  # the combining steps only (name, size, digest per file)
            assert {"adapter_config.json", "adapter_model.safetensors"} <= set(reader._watched)  # (peft's card too)
            assert isinstance(reader, LoraAdapterReader) and "model.safetensors" in reader.base._watched
            for key in changed:
                torch.testing.assert_close(reader.read(key).double(), oracle[key], rtol=1e-6, atol=1e-7)
            reader.verify_content()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.int8], ids=str)
def test_an_adapter_whose_factor_is_not_a_float_of_a_model_is_refused_by_name(
        root: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    """The reader would turn such a factor into fp32 (a complex one losing its imaginary part with a
    mere warning): refused when the adapter is opened instead, naming the file and the factor."""
    from testkit.lora_adapters import record_base

    copy = tmp_path / "odd"
    shutil.copytree(root / "client_0", copy)
    factors = load_file(str(copy / "adapter_model.safetensors"))
    name = sorted(factors)[0]
    factors[name] = factors[name].to(dtype)
    record_base(copy, root / "global", factors)
    with pytest.raises(CheckpointError, match=f"factor '{name}' has dtype {dtype}; a LoRA factor must be") as caught:
        open_checkpoint(CheckpointRef.for_directory(copy), root=tmp_path,
                        base=CheckpointRef.for_directory(root / "global"))
    assert str(copy / "adapter_model.safetensors") in str(caught.value)
