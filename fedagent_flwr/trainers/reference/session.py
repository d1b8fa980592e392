"""The reference trainer kept alive across rounds (``trainer.mode: persistent``).

One process per node serves every (round, client) job of the run (:mod:`.trainer_server`): the
interpreter, torch, transformers and the tokenizer are loaded once, and each job only loads its
starting weights into the model already in memory. Training and evaluation then run the very
same code as a fresh reference-trainer process (:mod:`.train`), seeded after the weights are in place, so the
two modes give bit-identical checkpoints: CI checks the persistent mechanism with it. The one
difference a setting can ask for: ``trainer.optimizer_state: keep`` carries each client's AdamW
state across its rounds (the subprocess mode has no process to keep it in).
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedagent_flwr.clientapp.job import EvalJob, EvalResult, TrainJob, TrainResult
from fedagent_flwr.trainers.common.evaluator import load_model
from fedagent_flwr.trainers.reference import train as rt

if TYPE_CHECKING:  # imports torch: loaded in train(), so the CLI checks its input before torch loads
    from fedagent_flwr.trainers.common import optimizer_state


class ModelCache:
    """One tokenizer and fp32 model, loaded from the first directory and afterwards refreshed by
    loading only the weights of the next directory into it (a full load if they do not fit)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.loads = 0  # full loads, for the tests and the log
        self.reloads = 0  # weight-only loads

    def get(self, path: Path, num_threads: int) -> tuple[Any, Any]:
        """The model holding the weights of ``path`` (in eval mode, no gradients) and its tokenizer."""
        import torch

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        if self.model is None or not self._load_weights(path):
            self.model, self.tokenizer = load_model(path, num_threads)
            self.loads += 1
        else:
            self.reloads += 1
        self.model.eval()
        self.model.zero_grad(set_to_none=True)
        return self.model, self.tokenizer

    def _load_weights(self, path: Path) -> bool:
        """Copy the safetensors weights of ``path`` into the cached model; False if they do not fit
        it (other architecture or shapes), so the caller loads the directory afresh.

        The files are read with the package's safetensors reader (:class:`.SafetensorsFile`), each
        tensor straight into the model's own parameter (cast on the way where the dtypes differ):
        the fit is checked from the headers alone, and no second copy of the model is held. A
        damaged file is refused by name at opening, and one shortened while it is read fails its
        read (CheckpointError) instead of killing the trainer with SIGBUS, as a memory-mapped read
        would; a model left half-loaded by a failed read is dropped, so the next job loads afresh.
        (The first load and a full load go through transformers, memory-mapped as before.)"""
        import torch

        from fedagent_flwr.checkpoint.safetensors_file import SafetensorsFile

        files = sorted(path.glob("*.safetensors"))
        if not files:
            return False
        with ExitStack() as stack:
            where = {key: handle for handle in (stack.enter_context(SafetensorsFile(f)) for f in files)
                     for key in handle.keys()}
            own = self.model.state_dict()
            if any(key not in own or tuple(own[key].shape) != handle.shape(key) for key, handle in where.items()):
                return False
            loaded = {own[key].data_ptr() for key in where}
            # A key the files leave out is fine only if it is tied to one they hold (lm_head ->
            # embed_tokens); anything else would silently keep the previous round's weights. Files
            # that hold both of two tied keys may hold two values, which a fresh load keeps apart
            # and one storage cannot: loaded afresh too.
            if len(loaded) < len(where) or any(own[key].data_ptr() not in loaded for key in own if key not in where):
                return False
            try:
                with torch.no_grad():
                    for key, handle in where.items():
                        handle.read_into(key, own[key])
            except BaseException:
                self.model = None
                raise
        return True


class ReferenceSession:
    """:class:`~fedagent_flwr.clientapp.trainer_server.TrainerSession` for the reference trainer.

    With ``trainer.optimizer_state: keep`` it also keeps the AdamW state a client's round ends
    with (:mod:`~fedagent_flwr.trainers.common.optimizer_state`) and loads it into the next
    round's optimiser, whose parameters then hold that round's global model; each result's
    ``optimizer_state_kept`` says whether it did (0.0 in the session's first round; absent with ``reset``).
    """

    def __init__(self) -> None:
        self.cache = ModelCache()
        self.kept: optimizer_state.KeptState | None = None  # the AdamW state of ...
        self.kept_from: tuple[int, int] | None = None  # ... this (client, round), completed

    def train(self, job: TrainJob) -> TrainResult:
        """Same checks, training and result file as :func:`.train.train`; only the load differs
        (and, with ``keep``, the optimiser's starting state)."""
        spec, cfg, model_path, rules = rt.check_train_job(job)
        started = time.monotonic()
        model, tokenizer = self.cache.get(model_path, cfg.num_threads)
        print(f"{rt.PROG}: persistent session: weights of {model_path} loaded into the live model "
              f"({self.cache.loads} full loads, {self.cache.reloads} reloads)", flush=True)
        from fedagent_flwr.trainers.common import optimizer_state

        if cfg.lora.rank > 0:
            # A fresh adapter goes onto the live model and comes off again, unmerged, when train_loaded ends
            # (lora.fresh_adapter), so the model keeps the global model's layout for the next load; its
            # optimiser (over the adapter alone) is made after it is attached. keep is refused with LoRA.
            self.kept = self.kept_from = None
            return rt.train_loaded(job, spec, cfg, rules, model, tokenizer, started, model_path=model_path)
        optimizer = rt.make_optimizer(model, cfg)
        if cfg.optimizer_state != "keep":
            self.kept = self.kept_from = None  # a later keep round must not revive a state from before this one
            # no optimizer_state_kept with reset: the metrics stay a subprocess-mode run's, which must be equal
            return rt.train_loaded(job, spec, cfg, rules, model, tokenizer, started, optimizer)
        # taken before loading: a round that fails part-way (a refused restore included) leaves no state
        kept_state, kept_from = self.kept, self.kept_from
        self.kept = self.kept_from = None
        kept = self._restore(optimizer, job, kept_state, kept_from)
        result = rt.train_loaded(job, spec, cfg, rules, model, tokenizer, started, optimizer,
                                 {"optimizer_state_kept": 1.0 if kept else 0.0})
        self.kept, self.kept_from = optimizer_state.take(_Holder(optimizer)), (job.client_id, job.round)
        return result

    @staticmethod
    def _restore(optimizer: Any, job: TrainJob, kept_state: optimizer_state.KeptState | None,
                 kept_from: tuple[int, int] | None) -> bool:
        """Load the state the same client's earlier round left (``kept_state``, from ``kept_from``)
        into ``optimizer``; False (and said) when there is none: the session's first round (or one
        after a failed round), another client's state, or a round run again (a resumed run whose
        trainer outlived the server)."""
        from fedagent_flwr.trainers.common import optimizer_state

        if kept_state is None or kept_from is None or kept_from[0] != job.client_id or kept_from[1] >= job.round:
            reason = ("no completed round" if kept_state is None or kept_from is None
                      else f"client {kept_from[0]}'s round {kept_from[1]}")
            print(f"{rt.PROG}: optimiser state: fresh (the state is from {reason}, not from an earlier round "
                  "of this client)", flush=True)
            return False
        where = f"round {job.round} client {job.client_id}"
        kept = optimizer_state.restore(_Holder(optimizer), kept_state, where) == optimizer_state.KEPT
        print(f"{rt.PROG}: optimiser state: {'kept from the previous round' if kept else 'fresh'}", flush=True)
        return kept

    def evaluate(self, job: EvalJob) -> EvalResult:
        """Same as :func:`.train.evaluate`, on a copy of the live model (evaluation moves
        it to the device and compute dtype; the cached fp32 master stays as it is)."""
        spec, cfg, model_path = rt.check_eval_job(job)
        started = time.monotonic()
        model, tokenizer = self.cache.get(model_path, cfg.num_threads)
        return rt.evaluate_loaded(job, spec, cfg, copy.deepcopy(model), tokenizer, started)

    def close(self) -> None:
        """Drop the model and any kept optimiser state (the process exits right after)."""
        self.cache = ModelCache()
        self.kept = self.kept_from = None


class _Holder:
    """The reference trainer's optimiser as :mod:`~fedagent_flwr.trainers.common.optimizer_state`
    reads an engine (no LR scheduler: the reference trainer's learning rate is constant)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.lr_scheduler = None
