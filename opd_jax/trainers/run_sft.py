"""The SFT driver: config -> model, data, optimizer -> steps with checkpoints and metrics.

Workdir layout::

    <workdir>/config.json        the exact config of the (first) run
    <workdir>/checkpoints/<step>/ Orbax: train state, data iterator, meta (model config)
    <workdir>/metrics.jsonl       one line per logged step; <workdir>/tb/ TensorBoard
"""
from __future__ import annotations

import functools
import json
import os

import jax
import ml_collections
from tqdm.auto import tqdm

from opd_jax import sharding as sh
from opd_jax.checkpoint import Checkpointer, abstract_like
from opd_jax.trainers import builders
from opd_jax.trainers.metrics import MetricsWriter
from opd_jax.trainers.sft import sft_step
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state


def check_workdir(workdir: str, model_meta: dict) -> Checkpointer:
    """Refuse a workdir whose checkpoints belong to a different model (before any write).

    Every ModelConfig field must match except EXECUTION_FIELDS (``remat``): switching
    gradient checkpointing on or off for a resumed run is allowed (same params, same values;
    checkpoints written before the option existed have no ``remat`` key)."""
    from opd_jax.models.config import EXECUTION_FIELDS
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    if ckpt.latest_step() is not None:
        keep = lambda d: {k: v for k, v in (d or {}).items() if k not in EXECUTION_FIELDS}
        saved, want = keep(ckpt.read_meta().get("model")), keep(model_meta)
        if saved != want:
            diff = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
            raise ValueError(f"workdir {workdir!r} holds a checkpoint of a different model "
                             f"(differs in: {', '.join(diff)}); use a new --workdir")
    return ckpt


def train_sft(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
    """Run (or resume) SFT; returns ``{"step", "loss", "checkpoint"}`` of the last step."""
    # Validate everything that needs no weights before building anything.
    mesh, rules, tokenizer, model_config = builders.setup(cfg)
    model_meta = model_config.to_dict()
    ckpt = check_workdir(workdir, model_meta)
    model = builders.build_model(cfg.model, mesh, rules, seed=cfg.seed)
    data = builders.build_sft_dataset(cfg.data, tokenizer)
    data_iter = iter(data)

    tx = make_optimizer(cfg.optim, cfg.train.steps)
    graphdef, state = create_state(model, tx)
    state, shardings = place_state(state, mesh, rules)
    start = 0
    if ckpt.latest_step() is not None:
        state, _ = ckpt.restore(None, abstract_like(state), data_iter)
        start = int(state.step)
    elif jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=2, default=str)

    step_fn = compile_step(
        functools.partial(sft_step, graphdef=graphdef, tx=tx, grad_accum=cfg.optim.grad_accum),
        shardings, mesh)
    writer = MetricsWriter(workdir)
    meta = {"model": model_meta, "kind": "sft"}
    last = {"step": start, "loss": float("nan")}
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
               desc="sft", disable=not progress or jax.process_index() != 0, dynamic_ncols=True)
    try:
        for step in bar:
            batch = sh.shard_batch(next(data_iter), mesh, rules)
            state, metrics = step_fn(state, batch)
            done = step + 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                metrics = jax.device_get(metrics)
                writer.write(done, metrics)
                bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
                last = {"step": done, "loss": float(metrics["loss"])}
            if done % cfg.train.ckpt_every == 0 or done == cfg.train.steps:
                ckpt.save(done, state, data_iter, meta)
    finally:
        ckpt.close()
        writer.close()
    last["checkpoint"] = os.path.join(ckpt.directory, str(ckpt.latest_step()))
    return last
