"""The verl trainer backend, run by the ClientApp as a subprocess::

    python -m fedagent_flwr.trainers.verl.entry train    JOB.json   # TrainJob
    python -m fedagent_flwr.trainers.verl.entry evaluate JOB.json   # EvalJob
    python -m fedagent_flwr.trainers.verl.entry serve    CHANNEL    # persistent (.persistent)

``train`` turns the TrainJob into one ``python -m verl.trainer.main_ppo`` job (GRPO, or PPO with a
federated critic) on this client's partition and reports its checkpoint as a TrainResult:

1. checks the job and the verl settings, and plans the rows (env instances) of every local step
   with the same seed rule as the reference trainer (:mod:`.dataset`);
2. writes the agent-loop registry YAML (verl's ``agent_loop_config_path``: the ``@register``
   decorator alone never reaches Ray's workers) and the Hydra overrides (:mod:`.overrides`);
3. starts verl in a session of its own with a scrubbed environment: no inherited ``RAY_*`` (a
   trainer must never join Flower's simulation cluster), a private Ray cluster and temp dir per
   job, the job's client rules (FedProx's when ``proximal_mu > 0``) armed in every actor worker
   through ``sitecustomize`` (:mod:`.user_hooks`);
4. tees verl's log to ``<output>/verl/verl.log``, reads its per-step metrics and timings from
   verl's file logger (``<output>/verl/steps.jsonl``, :mod:`.verl_log`; rewritten at the end in the
   form every client-round keeps, :func:`.job.keep_steps`, also when verl failed), appends a progress
   record per step (relayed to the server's log, :mod:`fedagent_flwr.progress`), and stops
   whatever is left of the job's Ray cluster when verl exits, also on failure or timeout;
5. refuses to report a result that is not there: a non-zero exit (crash, CUDA out of memory), a
   missing actor (or critic) checkpoint, no episode played, or FedProx (or another client rule)
   not active in every actor worker each exit non-zero with one line naming the cause and the log.

``evaluate`` plays the validation episodes with the global model through Hugging Face generation
on the node's GPU (the shared evaluator, :mod:`fedagent_flwr.trainers.common.evaluator`): a
135M-parameter model needs seconds for that, whereas a verl job would spend minutes starting Ray
and vLLM.

The library parts live beside this command: :mod:`.job` (checks, preparation, result, evaluation)
and :mod:`.runner` (the verl process and its Ray cluster).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from fedagent_flwr.clientapp.job import TrainJob, TrainResult, backend_main
from fedagent_flwr.trainers.common.checks import BAD_INPUT
from fedagent_flwr.trainers.verl.job import (
    PROG,
    STEPS_FILE,
    VerlJobFailed,
    collect_result,
    describe,
    evaluate,
    keep_steps,
    prepare_train,
    progress_reporter,
)
from fedagent_flwr.trainers.verl.persistent import VerlSession
from fedagent_flwr.trainers.verl.runner import failure_reason, run_verl


def train(job: TrainJob) -> TrainResult:
    """Run one verl job for ``job`` and write ``train_result.json``."""
    started = time.monotonic()
    prep = prepare_train(job)
    work = prep.work
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *prep.overrides]
    (work / "command.txt").write_text(" \\\n  ".join(command) + "\n")
    print(describe(job, prep), flush=True)
    code, first_step, tail, steps = run_verl(command, prep.env, work, work / "verl.log", prep.paths.ray_temp_dir,
                                             prep.step_file, progress_reporter(job, prep, started))
    if code != 0:
        keep_steps(prep.work / STEPS_FILE, steps)  # the steps verl logged before it failed, as a round keeps them
        raise VerlJobFailed(f"verl {failure_reason(code, tail, work / 'verl.log')} (log: {work / 'verl.log'})")
    return collect_result(job, prep, steps, first_step, started, str(work / "verl.log"),
                          extra_metrics=fresh_optimizer_metric(prep.settings.optimizer_state))


def fresh_optimizer_metric(setting: str) -> dict[str, float]:
    """``optimizer_state_kept`` = 0.0 for a job that asked to keep its optimiser state: a fresh
    process has none to keep. The server refuses ``keep`` with ``trainer.mode=subprocess``, so such
    a job is a persistent trainer's, rerun here after that trainer died or stalled (the ClientApp's
    fallback): it trains, from a new optimiser, and says so rather than failing the round."""
    return {"optimizer_state_kept": 0.0} if setting == "keep" else {}




_BAD_INPUT = (*BAD_INPUT, ValueError)


def session() -> VerlSession:
    """The persistent trainer's session (``serve CHANNEL_DIR``)."""
    return VerlSession()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``train`` / ``evaluate`` / ``serve``); exit status 0 ok, 2 bad input, 1 the verl job failed."""
    return backend_main(PROG, argv, train, evaluate, _BAD_INPUT, failures=(VerlJobFailed,),
                        session_factory=session)


if __name__ == "__main__":
    sys.exit(main())
