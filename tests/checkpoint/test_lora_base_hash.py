"""The global model a LoRA adapter is read on top of is checked against its reference's content hash:
a model changed on disk after the server wrote it would otherwise enter every client's virtual full
model as W (the adapters record the hash of the model they were trained on, which the server compares
with the reference's hash, not with the bytes). Its digests are shared by the round's adapters, so it
is hashed once per round, and its files are watched while they are read."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from fedagent_flwr.checkpoint import CheckpointError, CheckpointRef, LoraAdapterReader, open_checkpoint
from testkit.ckpt_factory import ModelSpec, write_hf_checkpoint
from testkit.file_change import flip_byte
from testkit.hash_count import count_hashed_files
from testkit.lora_adapters import write_adapter

TIED = ModelSpec("llama_tied_lora", "llama", seed=21, tie=True)


def _round(tmp_path: Path, clients: int = 1) -> tuple[Path, CheckpointRef, list[CheckpointRef]]:
    """A run root with the round's global model (and its reference, as the server wrote it) and
    ``clients`` adapters trained on it."""
    write_hf_checkpoint(TIED, tmp_path / "global")
    adapters = [CheckpointRef.for_directory(write_adapter(tmp_path / "global", tmp_path / f"client_{c}", seed=c))
                for c in range(clients)]
    return tmp_path / "global", CheckpointRef.for_directory(tmp_path / "global"), adapters


@pytest.mark.parametrize("check_hash", [True, "while-reading"])
def test_a_global_model_changed_on_disk_after_it_was_written_is_refused_naming_it(
        tmp_path: Path, check_hash: bool | str) -> None:
    global_dir, base, (adapter,) = _round(tmp_path)
    # one weight byte, after the round's global model was written and the client trained on it
    flip_byte(global_dir / "model.safetensors", restore_mtime=True, at=-1)
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(adapter, root=tmp_path, check_hash=check_hash, base=base)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(f"{global_dir}, the round's global model, has content hash ")
    assert f"its reference says {base.sha256[:16]}...: its files changed on disk" in message
    assert f"restore {global_dir} from a copy, or start the run over" in message
    # the ClientApp's merge of its own adapter (no hash check at all) still opens it
    with open_checkpoint(adapter, root=tmp_path, check_hash=False, base=base) as reader:
        assert isinstance(reader, LoraAdapterReader)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """The files hashed from now on, counted by name (each still hashed from disk)."""
    return count_hashed_files(monkeypatch)


def test_the_base_is_hashed_once_for_all_the_rounds_adapters_and_watched_while_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed: collections.Counter[str]) -> None:
    from fedagent_flwr.checkpoint import audit_digests
    from fedagent_flwr.checkpoint.audit_digests import AuditDigests

    monkeypatch.setattr(audit_digests, "RACY_NS", 0)  # the global model was written a moment ago
    global_dir, base, adapters = _round(tmp_path, clients=3)
    hashed.clear()  # writing the adapters hashed it (the hash they record), as the clients do
    digests = AuditDigests()  # the strategy's for the round (serverapp.strategy.sources.round_sources)
    readers = [open_checkpoint(ref, root=tmp_path, check_hash="while-reading", base=base, base_digests=digests)
               for ref in adapters]
    try:
        assert hashed["model.safetensors"] == 1  # the base's weights; an adapter's file has its own name
        for reader in readers:
            assert isinstance(reader, LoraAdapterReader) and "model.safetensors" in reader.base._watched
            reader.read(reader.targets[0])
            reader.verify_content()  # unchanged: passes
        # changed while the round reads it: each adapter's check after the reads refuses it
        flip_byte(global_dir / "model.safetensors", restore_mtime=True, at=-1)
        for reader in readers:
            with pytest.raises(CheckpointError, match=f"{global_dir / 'model.safetensors'} changed while it was read"):
                reader.verify_content()
    finally:
        for reader in readers:
            reader.close()
    # and opened again (the strategy's retry after a culprit): refused, without hashing the unchanged config again
    before = hashed["config.json"]
    with pytest.raises(CheckpointError, match=f"{global_dir}, the round's global model"):
        open_checkpoint(adapters[0], root=tmp_path, base=base, base_digests=digests)
    assert hashed["config.json"] == before


def _record_scheme(adapter: Path, scheme: str | None) -> None:
    """Rewrite the adapter's factors with its recorded base hash and ``scheme`` beside it (None: no entry)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    metadata.pop("fedagent.base_sha256_version", None)
    save_file(load_file(str(path)), str(path), {**metadata, **({} if scheme is None else
                                                               {"fedagent.base_sha256_version": scheme})})


def test_a_base_hash_of_another_content_hash_scheme_is_refused_saying_so(tmp_path: Path) -> None:
    """The hash an adapter records of its base was computed with a content-hash scheme; one of another
    scheme than this code's cannot be compared, which is said as such (not as another model). An adapter
    recording none (written before the scheme was recorded) reads as before."""
    from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION

    _, base, (adapter,) = _round(tmp_path)
    adapter_dir = Path(adapter.path)
    for scheme in (None, CONTENT_HASH_VERSION):
        _record_scheme(adapter_dir, scheme)
        with open_checkpoint(CheckpointRef.for_directory(adapter_dir), root=tmp_path, base=base) as reader:
            assert isinstance(reader, LoraAdapterReader)
    _record_scheme(adapter_dir, "v1")
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(CheckpointRef.for_directory(adapter_dir), root=tmp_path, base=base)
    assert str(refused.value) == (
        f"{adapter_dir / 'adapter_model.safetensors'} records the content hash of the model it was trained on as "
        f"computed by content hash v1, and this fedagent-flwr computes {CONTENT_HASH_VERSION}: the two cannot be "
        "compared, so it is not read on any model (read it with the fedagent-flwr that wrote it)")


def test_the_reference_trainer_records_the_scheme_beside_the_base_hash(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fedagent_flwr.checkpoint.content_hash import CONTENT_HASH_VERSION
    from fedagent_flwr.schema.lora import Lora
    from fedagent_flwr.trainers.reference.lora import fresh_adapter, write_adapter_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    base_sha256 = CheckpointRef.for_directory(tiny_model_dir).sha256
    with fresh_adapter(model, Lora(rank=4, alpha=8), 1) as peft_model:
        actor = write_adapter_checkpoint(peft_model, tmp_path / "global_step_1", base_sha256)
    with safe_open(str(actor / "adapter_model.safetensors"), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["fedagent.base_sha256"] == base_sha256
    assert metadata["fedagent.base_sha256_version"] == CONTENT_HASH_VERSION
