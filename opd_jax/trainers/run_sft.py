"""The SFT driver: config -> model, data, optimizer -> steps with checkpoints and metrics.

Workdir layout::

    <workdir>/config.json         the config the run is under (changes: config_changes.jsonl)
    <workdir>/run.lock            held by the running process (pid, host; see WorkdirLock)
    <workdir>/checkpoints/<step>/ Orbax: train state, data iterator, meta (model config,
                                  tokenizer identity, per-array checksums)
    <workdir>/metrics.jsonl       one line per logged step; <workdir>/tb/ TensorBoard

`open_workdir` (shared with the policy trainer) checks, before any weights are built, that
the workdir is a writable folder held by no other run, and that a resumed run has the
model and the config of its checkpoints (only `RESUMABLE` fields may differ, or any with
``resume_with_changes``, which records the change).
"""
from __future__ import annotations

import functools
import json
import os
import time

import jax
import ml_collections
from tqdm.auto import tqdm

from opd_jax import sharding as sh
from opd_jax.checkpoint import Checkpointer, WorkdirError, WorkdirLock, abstract_like
from opd_jax.checkpoint import prepare_workdir
from opd_jax.trainers import builders
from opd_jax.trainers.metrics import DivergenceGuard, MetricsWriter
from opd_jax.trainers.sft import sft_step
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state

# Config keys a resumed run may change without --resume_with_changes: they extend the run,
# change how often it logs or saves, how it is executed (mesh, remat, teacher cache) or
# evaluated, none of what the checkpointed state means. A trailing "." is a whole section.
RESUMABLE = ("train.steps", "train.log_every", "train.ckpt_every", "train.keep_checkpoints",
             "train.max_bad_steps", "model.remat", "model.init_from", "mesh.", "eval.",
             "teachers.max_loaded")


def check_workdir(workdir: str, model_meta: dict, *, keep: int = 2) -> Checkpointer:
    """Refuse a workdir whose checkpoints belong to a different model (before any write).

    Every ModelConfig field must match except EXECUTION_FIELDS (``remat``): switching
    gradient checkpointing on or off for a resumed run is allowed (same params, same values;
    checkpoints written before the option existed have no ``remat`` key)."""
    from opd_jax.models.config import EXECUTION_FIELDS
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)
    if ckpt.latest_step() is not None:
        keep = lambda d: {k: v for k, v in (d or {}).items() if k not in EXECUTION_FIELDS}
        saved, want = keep(ckpt.read_meta().get("model")), keep(model_meta)
        if saved != want:
            diff = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
            raise ValueError(f"workdir {workdir!r} holds a checkpoint of a different model "
                             f"(differs in: {', '.join(diff)}); use a new --workdir")
    return ckpt


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(saved: dict, cfg: ml_collections.ConfigDict, *,
                include_resumable: bool = False) -> dict[str, tuple]:
    """{dotted key: (saved value, new value)} of the keys both configs have and that
    differ, outside RESUMABLE unless `include_resumable` (keys only one side has are
    framework versions, ignored)."""
    old = _flat(saved)
    new = _flat(json.loads(json.dumps(cfg.to_dict(), default=str)))
    resumable = lambda k: any(k == r or (r.endswith(".") and k.startswith(r))  # noqa: E731
                              for r in RESUMABLE)
    return {k: (old[k], new[k]) for k in sorted(set(old) & set(new))
            if old[k] != new[k] and (include_resumable or not resumable(k))}


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def open_workdir(workdir: str, cfg: ml_collections.ConfigDict, model_meta: dict, *,
                 resume_with_changes: bool = False) -> Checkpointer:
    """The run's Checkpointer, holding the workdir lock (released by its ``close()``).

    Before any weights are built: the workdir is a writable folder, no other run holds it,
    its checkpoints are of this model (`check_workdir`), and a resumed run's config equals
    the saved ``config.json`` outside `RESUMABLE` fields. A differing config is refused with
    the diff unless `resume_with_changes`. Any accepted change (resumable ones too) is
    appended to ``config_changes.jsonl`` and ``config.json`` rewritten, so it always holds
    the config the run is under. A fresh run writes ``config.json``.
    """
    lead = jax.process_index() == 0
    lock = None
    if lead:
        workdir = prepare_workdir(workdir)
        lock = WorkdirLock(workdir)
    try:
        ckpt = check_workdir(workdir, model_meta, keep=cfg.train.get("keep_checkpoints", 2))
        path = os.path.join(workdir, "config.json")
        latest = ckpt.latest_step()
        changes = {}
        if latest is not None and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            diff = config_diff(saved, cfg)
            changes = config_diff(saved, cfg, include_resumable=True)
            if diff and not resume_with_changes:
                lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in
                                  ((k, *v) for k, v in diff.items()))
                raise WorkdirError(
                    f"workdir {workdir!r} holds a run (checkpoint step {latest}) under another "
                    f"config: {lines}. Resume with the saved config, use a new --workdir, or "
                    f"pass --resume_with_changes to continue under the new values (resumable "
                    f"without it: {', '.join(RESUMABLE)})")
            if changes and lead:     # resumable ones too: config.json is the run's config
                with open(os.path.join(workdir, "config_changes.jsonl"), "a",
                          encoding="utf-8") as f:
                    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "from_step": latest,
                                        "changes": {k: {"from": a, "to": b}
                                                    for k, (a, b) in changes.items()}},
                                       default=str) + "\n")
        if lead and (latest is None or changes or not os.path.isfile(path)):
            _write_json(path, cfg.to_dict())
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    ckpt.lock = lock
    return ckpt


def train_sft(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
              resume_with_changes: bool = False) -> dict:
    """Run (or resume) SFT; returns ``{"step", "loss", "checkpoint"}`` of the last step.

    A step with a non-finite loss or gradient norm stops the run (DivergenceError) before
    it is saved, unless ``train.max_bad_steps`` allows skipping it."""
    # Validate everything that needs no weights before building anything.
    mesh, rules, tokenizer, model_config = builders.setup(cfg)
    data = builders.build_sft_dataset(cfg.data, tokenizer)     # every JSONL record checked
    model_meta = model_config.to_dict()
    ckpt = open_workdir(workdir, cfg, model_meta, resume_with_changes=resume_with_changes)
    try:
        model = builders.build_model(cfg.model, mesh, rules, seed=cfg.seed)
        data_iter = iter(data)
        tx = make_optimizer(cfg.optim, cfg.train.steps)
        graphdef, state = create_state(model, tx)
        state, shardings = place_state(state, mesh, rules)
        start = 0
        if ckpt.latest_step() is not None:
            state, _ = ckpt.restore(None, abstract_like(state), data_iter)
            start = int(state.step)
        max_bad = cfg.train.get("max_bad_steps", 0)
        step_fn = compile_step(
            functools.partial(sft_step, graphdef=graphdef, tx=tx,
                              grad_accum=cfg.optim.grad_accum),
            shardings, mesh, skip_nonfinite=max_bad > 0)
        guard = DivergenceGuard(max_bad, lr=cfg.optim.lr)
        writer = MetricsWriter(workdir, resume_step=start)
    except BaseException:
        ckpt.close()
        raise
    meta = {"model": model_meta, "kind": "sft",
            "tokenizer": builders.tokenizer_meta(cfg.tokenizer, tokenizer)}
    last = {"step": start, "loss": float("nan")}
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
               desc="sft", disable=not progress or jax.process_index() != 0, dynamic_ncols=True)
    pending = None      # (step, metrics) checked after the next step is dispatched
    try:
        for step in bar:
            batch = sh.shard_batch(next(data_iter), mesh, rules)
            state, metrics = step_fn(state, batch)
            done = step + 1
            if pending is not None:
                guard.check(*pending, last_checkpoint=ckpt.latest_step())
            pending = (done, metrics)
            log_now = done % cfg.train.log_every == 0 or done == cfg.train.steps
            save_now = done % cfg.train.ckpt_every == 0 or done == cfg.train.steps
            if log_now:     # logged before the check: a diverged step is on record too
                metrics = jax.device_get(metrics)
                writer.write(done, metrics)
                bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
                last = {"step": done, "loss": float(metrics["loss"])}
            if log_now or save_now:
                guard.check(done, metrics, last_checkpoint=ckpt.latest_step())
                pending = None
            if save_now:
                ckpt.save(done, state, data_iter, meta)
    finally:
        ckpt.close()
        writer.close()
    last["checkpoint"] = os.path.join(ckpt.directory, str(ckpt.latest_step()))
    if guard.skipped:
        last["skipped_steps"] = list(guard.skipped)
    return last
