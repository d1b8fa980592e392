"""A trainer backend for the persistent-trainer tests: a session that does what the job's
``trainer.script`` says and takes ``trainer.close_s`` to close.

Scripts: ``ok``, ``fail``, ``sleep:<s>``; for the progress watchdog ``hang`` (one line, then
silence), ``warn`` (then only vLLM's stall warning), ``bar`` (a progress bar redrawn after ``\r``
for 4.8 s, with no newline until it is full) and ``stall_in_session`` (hangs in a
persistent trainer, trains normally in a fresh subprocess: issue 18's stuck verl session);
``killed`` (SIGKILL to its own process, no last words, as the out-of-memory killer ends it);
``refuse_settings`` (every session, a fresh one too, refuses the job for its fixed settings).
``trainer.fixed`` is a setting the session fixes with its first train job, as a verl session
fixes its own: a later job asking for another value is refused (:class:`SessionSettingsFixed`,
naming ``trainer.fixed``). The subprocess path (``train JOB.json``) runs the same session code.
:func:`scripted_job` writes the train job that tells a session what to do.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fedagent_flwr.clientapp.job import EvalJob, EvalResult, TrainJob, TrainResult, backend_main, save
from fedagent_flwr.clientapp.trainer_server import CHANNEL_ENV, SessionSettingsFixed
from testkit.sleepy_backend import STALL_WARNING, progress_bar


class ScriptedSession:
    def __init__(self) -> None:
        self.close_s = 0.0
        self.fixed: dict[str, object] | None = None  # {"trainer.fixed": value} once a job fixed it

    def train(self, job: TrainJob) -> TrainResult:
        script = str(job.trainer.get("script", "ok"))
        self.close_s = float(job.trainer.get("close_s", 0.0))
        served = bool(os.environ.get(CHANNEL_ENV))
        wanted = {"trainer.fixed": job.trainer.get("fixed")}
        if script == "refuse_settings" or (self.fixed is not None and self.fixed != wanted):
            raise SessionSettingsFixed(f"this job needs trainer.fixed={wanted['trainer.fixed']!r}, the scripted "
                                       f"session started with {self.fixed!r}", ["trainer.fixed"])
        self.fixed = wanted
        print(f"scripted train round {job.round}: {script} ({'persistent' if served else 'subprocess'})", flush=True)
        if script == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if script == "fail":
            raise RuntimeError(f"scripted failure in round {job.round}")
        if script == "bar":
            progress_bar()
        if script.startswith("sleep:"):
            time.sleep(float(script.split(":", 1)[1]))
        if script in ("hang", "warn") or (script == "stall_in_session" and served):
            while True:
                time.sleep(0.2)
                if script == "warn":
                    print(STALL_WARNING, flush=True)
        result = TrainResult(actor_dir=job.output_dir, actor_format="fsdp-shards", num_episodes=1, metrics={})
        save(result, Path(job.output_dir) / "train_result.json")
        return result

    def evaluate(self, job: EvalJob) -> EvalResult:
        result = EvalResult(num_episodes=1, success_rate=0.0, reward_mean=0.0)
        save(result, Path(job.output_dir) / "eval_result.json")
        return result

    def close(self) -> None:
        time.sleep(self.close_s)  # a verl session needs seconds to stop Ray


def scripted_job(tmp: Path, name: str, **trainer: Any) -> Path:
    """Write (to ``tmp/<name>.json``) a train job for this backend, whose ``trainer`` settings
    (``script``, ``close_s``, ``fixed``, ...) say what its session does; it writes to ``tmp/<name>``."""
    job = TrainJob(model_path="unused", output_dir=str(tmp / name), env_spec={}, round=1, client_id=0,
                   num_clients=1, data_seed=1, trainer=trainer)
    path = tmp / f"{name}.json"
    save(job, path)
    return path


if __name__ == "__main__":
    sys.exit(backend_main("scripted", None, lambda job: ScriptedSession().train(job),
                          lambda job: ScriptedSession().evaluate(job), (ValueError,),
                          session_factory=ScriptedSession))
