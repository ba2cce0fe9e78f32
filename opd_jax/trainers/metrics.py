"""Metrics sinks: JSONL (always) and TensorBoard (tensorboardX), written by process 0."""
from __future__ import annotations

import json
import os
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
