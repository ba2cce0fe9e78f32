"""Metrics sinks: JSONL (always) and TensorBoard (tensorboardX), written by process 0;
the divergence guard that reads every step's metrics."""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping

import jax
import numpy as np


class MetricsWriter:
    def __init__(self, workdir: str, *, tensorboard: bool = True):
        self._active = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        if not self._active:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._active:
            return
        scalars = {k: float(np.asarray(v)) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
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
