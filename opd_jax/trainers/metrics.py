"""Metrics sinks: JSONL (always) and TensorBoard (tensorboardX), written by process 0;
the divergence guard that reads every step's metrics."""
from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping

import jax
import numpy as np


class MetricsWriter:
    """Appends one record per logged step to ``<workdir>/metrics.jsonl`` and the same
    scalars to TensorBoard (``<workdir>/tb``).

    Resumed runs keep one record per step. A run killed after logging step k but before
    its checkpoint resumes from an earlier step s and logs s+1.. again; those records of
    the lost run are dropped from ``metrics.jsonl`` (an atomic rewrite: temp file +
    rename; the dropped lines are appended to ``metrics.dropped.jsonl``, kept for
    forensics) either at open, when the caller passes ``resume_step=s`` (records with
    step > s), or otherwise before the first write of this writer at step t (records
    with step >= t). TensorBoard event files cannot be truncated: the writer of a
    resumed run opens a new event file with tensorboardX's ``purge_step`` (a
    ``SessionLog.START`` at that step), which makes TensorBoard hide the earlier events
    of steps >= it, so re-logged steps are not shown twice (readers that ignore
    ``SessionLog`` events, such as a plain event-file parser, still see both)."""

    def __init__(self, workdir: str, *, tensorboard: bool = True,
                 resume_step: int | None = None):
        self._active = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        self._tensorboard = tensorboard
        self._first = True
        if not self._active:
            return
        os.makedirs(workdir, exist_ok=True)
        self._dir = workdir
        self._path = os.path.join(workdir, "metrics.jsonl")
        # an earlier run wrote here: its records past the resume point are superseded
        self._resumed = os.path.isfile(self._path) and os.path.getsize(self._path) > 0
        self._purge_step = None
        if resume_step is not None and self._resumed:
            self._drop_from(int(resume_step) + 1)
        self._jsonl = open(self._path, "a", encoding="utf-8")
        if tensorboard:
            os.makedirs(os.path.join(workdir, "tb"), exist_ok=True)
            if resume_step is not None:
                self._open_tb(int(resume_step) + 1 if self._resumed else None)

    def _open_tb(self, purge_step: int | None) -> None:
        from tensorboardX import SummaryWriter   # lazy: start-up time (imports protobuf)
        # tensorboardX names event files by the second; the ns suffix keeps a quick resume
        # from overwriting the previous run's file (and sorts after it)
        self._tb = SummaryWriter(os.path.join(self._dir, "tb"), purge_step=purge_step,
                                 filename_suffix=f".{time.time_ns()}")

    def _drop_from(self, step: int) -> int:
        """Atomically rewrite metrics.jsonl without the records of step >= `step`; returns
        how many were dropped (0: the file is left untouched)."""
        with open(self._path, encoding="utf-8") as f:
            lines = f.readlines()
        keep, drop = [], []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                if i == len(lines) - 1 and not line.endswith("\n"):
                    drop.append(line + "\n")   # torn by a kill mid-write
                    continue
                keep.append(line)      # not ours to judge: left for read_metrics to report
                continue
            (drop if rec_step >= step else keep).append(line if line.endswith("\n")
                                                       else line + "\n")
        if not drop:
            return 0
        tmp = self._path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(self._dir, "metrics.dropped.jsonl"), "a",
                  encoding="utf-8") as f:
            f.writelines(drop)
        os.replace(tmp, self._path)
        return len(drop)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._active:
            return
        step = int(step)
        if self._first:     # a resumed run: what an earlier run logged from here is stale
            self._first = False
            if self._resumed and self._drop_from(step):
                self._jsonl.close()
                self._jsonl = open(self._path, "a", encoding="utf-8")
            if self._tensorboard and self._tb is None:
                self._open_tb(step if self._resumed else None)
        scalars = {k: float(np.asarray(v)) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class DivergenceError(ValueError):
    """Training produced a non-finite loss or gradient norm; nothing of it was saved."""


class DivergenceGuard:
    """Stops a run at the first step whose loss or gradient norm is NaN or inf (the
    ``nonfinite`` metric of `opd_jax.trainers.state.compile_step`), before any checkpoint
    of that state is written.

    ``max_bad_steps > 0`` (``train.max_bad_steps``; compile the step with
    ``skip_nonfinite=True``): such steps were skipped in the step itself (the state kept)
    and are counted with a warning; the run stops at the ``max_bad_steps + 1``-th."""

    def __init__(self, max_bad_steps: int = 0, *, unit: str = "step", lr: float | None = None):
        if max_bad_steps < 0:
            raise ValueError(f"train.max_bad_steps={max_bad_steps}: expected an int >= 0")
        self.max_bad_steps, self.unit, self.lr, self.skipped = int(max_bad_steps), unit, lr, []

    def check(self, step: int, metrics: Mapping, last_checkpoint: int | None = None) -> None:
        """Raise DivergenceError if `metrics` (of `step`) are non-finite past the bound."""
        if not float(np.asarray(metrics["nonfinite"])):
            return
        loss, gnorm = (float(np.asarray(metrics[k])) for k in ("loss", "grad_norm"))
        self.skipped.append(int(step))
        if len(self.skipped) <= self.max_bad_steps:
            warnings.warn(f"{self.unit} {step}: loss {loss} / grad_norm {gnorm} is not finite; "
                          f"skipped it ({len(self.skipped)} of train.max_bad_steps="
                          f"{self.max_bad_steps})", RuntimeWarning, stacklevel=2)
            return
        kept = (f"the last checkpoint is step {last_checkpoint}, untouched"
                if last_checkpoint is not None else "no checkpoint was written")
        skipped = (f" after skipping {self.unit}s {self.skipped[:-1]}"
                   if self.max_bad_steps else "")
        raise DivergenceError(
            f"training diverged at {self.unit} {step}: loss {loss}, grad_norm {gnorm} "
            f"(not finite){skipped}; stopped before saving it ({kept}). Lower optim.lr"
            + (f" (now {self.lr:g})" if self.lr is not None else "")
            + " or set train.max_bad_steps to skip such steps")
