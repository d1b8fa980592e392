"""A LoRA attach that fails part-way leaves the live model as it was: a persistent session answers
the job (bad input keeps it serving) and trains or evaluates its next job on that same model, so
peft's wrappers, frozen flags and ``peft_config`` must all be gone again; where that cannot be
done, ModelNotRestored (not bad input) ends the session instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedagent_flwr.schema.lora import Lora
from fedagent_flwr.trainers.common.checks import InputError
from fedagent_flwr.trainers.reference.lora import ModelNotRestored, fresh_adapter

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}


def _model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.lm_head.weight.requires_grad_(False)  # whatever the flags were, they come back
    return model


def _state(model: Any) -> tuple[list[tuple[str, int, type]], list[tuple[str, int, bool]], dict[str, torch.Tensor]]:
    """Modules (name, object, type), parameters (name, object, requires_grad) and values of ``model``."""
    return ([(name, id(module), type(module)) for name, module in model.named_modules()],
            [(name, id(param), param.requires_grad) for name, param in model.named_parameters()],
            {name: value.detach().clone() for name, value in model.state_dict().items()})


def _wrapped_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The target modules peft wraps from now on, by name (so a test can tell the failure came after some)."""
    from peft.tuners.lora import LoraModel

    wrapped: list[str] = []
    create = LoraModel._create_and_replace

    def counting(self: Any, config: Any, adapter_name: str, target: Any, target_name: str, parent: Any,
                 current_key: str, **kwargs: Any) -> Any:
        result = create(self, config, adapter_name, target, target_name, parent, current_key=current_key, **kwargs)
        wrapped.append(current_key)
        return result

    monkeypatch.setattr(LoraModel, "_create_and_replace", counting)
    return wrapped


@pytest.mark.parametrize("failure", ["a target that is no linear layer", "peft failing after the whole attach"])
def test_an_attach_that_fails_after_layers_were_wrapped_leaves_the_model_as_it_was(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    from peft.tuners.lora import LoraModel

    model = _model(tiny_model_dir)
    modules, params, values = _state(model)
    wrapped = _wrapped_counter(monkeypatch)
    settings = dict(LORA)
    if failure == "a target that is no linear layer":
        # peft wraps layer 0's q_proj, then refuses layer 0's MLP: bad input, the session keeps serving
        settings["target_modules"] = ["q_proj", "mlp"]
        expected: type[Exception] = InputError
    else:
        # after every target is wrapped, the flags are frozen and peft_config is on the model
        def boom(self: Any, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
            assert not model.model.embed_tokens.weight.requires_grad and hasattr(model, "peft_config")
            raise RuntimeError("peft failed late")

        monkeypatch.setattr(LoraModel, "_cast_adapter_dtype", boom)
        expected = RuntimeError
    with pytest.raises(expected) as caught, fresh_adapter(model, Lora(**settings), 3):  # type: ignore[arg-type]
        pytest.fail("the attach was to fail")
    assert not isinstance(caught.value, ModelNotRestored)
    # it did fail after wrapping: layer 0's q_proj (before its MLP), or all eight attention projections
    assert wrapped == ["model.layers.0.self_attn.q_proj"] if expected is InputError else len(wrapped) == 8
    after_modules, after_params, after_values = _state(model)
    assert after_modules == modules
    assert after_params == params  # names, objects and requires_grad flags
    assert set(after_values) == set(values) and all(torch.equal(after_values[k], values[k]) for k in values)
    assert not hasattr(model, "peft_config")
    # and the next job's adapter attaches and comes off as on a model that never saw the failed one
    monkeypatch.undo()
    with fresh_adapter(model, Lora(**LORA), 3) as peft_model:  # type: ignore[arg-type]
        assert sum(".lora_A." in name for name, _ in peft_model.named_parameters()) == 8
    assert _state(model)[:2] == (modules, params)


def test_a_model_that_cannot_be_put_back_is_not_served_again(tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A change the record cannot undo (here a forward hook, as peft's gradient-checkpointing preparation
    adds one) is ModelNotRestored: no bad input, so the persistent session ends rather than serve on."""
    from peft.tuners.lora import LoraModel

    model = _model(tiny_model_dir)

    def hooked(self: Any, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: None)
        raise RuntimeError("peft failed late")

    monkeypatch.setattr(LoraModel, "_cast_adapter_dtype", hooked)
    with pytest.raises(ModelNotRestored, match="not used again") as caught, \
            fresh_adapter(model, Lora(**LORA), 3):  # type: ignore[arg-type]
        pytest.fail("the attach was to fail")
    assert isinstance(caught.value.__context__, RuntimeError)  # the cause is kept
    assert not isinstance(caught.value, InputError)
