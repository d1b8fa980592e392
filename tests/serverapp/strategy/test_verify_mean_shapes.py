"""The weighted mean's audit reads its sources by rows, so a client's checkpoint holding a tensor
longer than the written global model's (more rows) would be compared in part, its extra rows never
read, and the round would pass: it is refused with one line naming both files and shapes, whichever
client sent it (the first is the audit's reference, the others are checked against it). On a real
FedAvg round; the longer file is recommitted (:func:`testkit.near_one.recommit_source`) so that no
hash check is what catches it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedagent_flwr.checkpoint.verify import main as verify
from fedagent_flwr.serverapp.strategy import FedAvgFSDP
from testkit.near_one import near_one, recommit_source, small_change_round
from testkit.strategy_setup import connected_strategy

MODEL = "model.safetensors"
KEY = "model.embed_tokens.weight"


@pytest.mark.parametrize("client", [0, 1])
def test_a_client_checkpoint_longer_than_the_global_model_is_refused_not_read_in_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], client: int,
) -> None:
    strategy, run_root = connected_strategy(tmp_path, near_one(tmp_path, 6), FedAvgFSDP, clients=2)
    small_change_round(strategy, run_root, 1, 41)
    capsys.readouterr()
    assert verify([str(run_root)]) == 0
    source = run_root / "round_1" / f"client_{client}" / "model"
    with safe_open(str(source / MODEL), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(source / MODEL))
    rows, width = tensors[KEY].shape
    # 5 rows more, far off: rows 0..n-1 are unchanged, so reading only the global model's rows would pass
    tensors[KEY] = torch.cat([tensors[KEY], torch.full((5, width), 123.0)])
    save_file(tensors, str(source / MODEL), metadata)
    recommit_source(run_root, client)
    capsys.readouterr()
    assert verify([str(run_root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    first = run_root / "round_1" / "client_0" / "model"
    where = run_root / "round_1" / "global" / MODEL if client == 0 else source
    shapes = ((rows, width), (rows + 5, width)) if client == 0 else ((rows + 5, width), (rows, width))
    assert lines == [f"round 1: cannot verify: {where}: '{KEY}' has shape {shapes[0]}, the first source {first} "
                     f"has {shapes[1]}"], lines
