"""The SFT driver: config -> model, data, optimizer -> steps with checkpoints and metrics.

Workdir layout::

    <workdir>/config.json         the config the run is under (changes: config_changes.jsonl)
    <workdir>/run.lock            held by the running process (pid, host; see WorkdirLock)
    <workdir>/checkpoints/<step>/ Orbax: train state, data iterator, meta (model config,
                                  tokenizer identity, per-array checksums)
    <workdir>/metrics.jsonl       one line per logged step; <workdir>/tb/ TensorBoard

The run skeleton (`trainers.run.Run`, shared with the policy trainer) opens the workdir
(`trainers.workdir.open_workdir`: before any weights are built, the workdir is a writable
folder held by no other run, and a resumed run has the model and the config of its
checkpoints; only `RESUMABLE` fields may differ, or any with ``resume_with_changes``, which
records the change), builds and restores the state, and checks divergence one step late.
"""
from __future__ import annotations

import functools
import os

import jax
import ml_collections

from opd_jax import sharding as sh
from opd_jax.trainers import builders, compute
from opd_jax.trainers.metrics import read_metrics
from opd_jax.trainers.run import Run, Setup
from opd_jax.trainers.sft import sft_step


def train_sft(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
              resume_with_changes: bool = False) -> dict:
    """Run (or resume) SFT; returns ``{"step", "loss", "checkpoint"}`` of the last step.

    A step with a non-finite loss or gradient norm stops the run (DivergenceError) before
    it is saved, unless ``train.max_bad_steps`` allows skipping it."""
    # Validate everything that needs no weights before building anything.
    setup = Setup.of(cfg)
    data_iter = iter(builders.build_sft_dataset(cfg.data, setup.tokenizer))  # records checked
    total, t = cfg.train.steps, cfg.train
    run = Run.open(cfg, workdir, kind="sft", setup=setup, optimizer_steps=total,
                   iterator=data_iter, resume_with_changes=resume_with_changes)
    try:
        step_fn = run.compile(functools.partial(sft_step, graphdef=run.graphdef, tx=run.tx,
                                                grad_accum=cfg.optim.grad_accum))
        last = {"step": run.start, "loss": float("nan")}
        if run.start >= total:      # a finished run: report its last logged loss, not nan
            logged = [m for m in read_metrics(workdir) if "loss" in m]
            last = {"step": run.start, "loss": float(logged[-1]["loss"]) if logged
                    else float("nan"), "finished_before": True}
        bar = run.progress(total, desc="sft", enabled=progress)
        for step in bar:
            batch = sh.shard_batch(next(data_iter), setup.mesh, setup.rules)
            run.state, metrics = step_fn(run.state, batch)
            done = step + 1
            run.check_late(done, metrics)
            log_now, save_now = run.due(done, t.log_every, total), run.due(done, t.ckpt_every,
                                                                           total)
            if log_now:     # logged before the check: a diverged step is on record too
                metrics = jax.device_get(metrics)
                run.writer.write(done, metrics)
                bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
                last = {"step": done, "loss": float(metrics["loss"])}
            if log_now or save_now:
                run.check_now()
            if save_now:
                run.save(done)
    finally:
        run.close()
    if jax.process_index() == 0:
        # every position of the rows of every optimizer step (module doc of `compute`)
        rows = cfg.data.batch_size * cfg.data.seq_len
        compute.write(workdir, compute.Compute(trained=total * rows),
                      setup.model_config.num_params())
    last["checkpoint"] = os.path.join(run.ckpt.directory, str(run.ckpt.latest_step()))
    if run.guard.skipped:
        last["skipped_steps"] = list(run.guard.skipped)
    return last
