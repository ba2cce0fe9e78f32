"""A run's workdir: the lock, the checkpoints' model check and the config pin.

`open_workdir` is the first thing every trainer does after its config checks and before
any weights are built (`opd_jax.trainers.run.Run`)."""
from __future__ import annotations

import json
import os
import time

import jax
import ml_collections

from opd_jax.checkpoint import Checkpointer, WorkdirError, WorkdirLock, prepare_workdir
from opd_jax.models.config import EXECUTION_FIELDS

# Config keys a resumed run may change without --resume_with_changes: they extend the run,
# change how often it logs or saves, how it is executed (mesh, remat, teacher cache) or
# evaluated, none of what the checkpointed state means. A trailing "." is a whole section.
RESUMABLE = ("train.steps", "train.log_every", "train.ckpt_every", "train.keep_checkpoints",
             "train.max_bad_steps", "model.remat", "model.init_from", "mesh.", "eval.",
             "teachers.max_loaded")


def check_workdir(workdir: str, model_meta: dict, *, keep: int = 2,
                  tokenizer: dict | None = None) -> Checkpointer:
    """Refuse a workdir whose checkpoints belong to a different model (before any write).

    Every ModelConfig field must match except EXECUTION_FIELDS (``remat``): switching
    gradient checkpointing on or off for a resumed run is allowed (same params, same values;
    checkpoints written before the option existed have no ``remat`` key). `tokenizer` (the
    run's ``{"spec", "fingerprint"}``) must be the one the checkpoints record: token ids
    mean text only under their tokenizer, so no flag (not ``--resume_with_changes``)
    switches it mid-run."""
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)
    if ckpt.latest_step() is not None and tokenizer is not None:
        saved = ckpt.read_meta().get("tokenizer")
        if saved and saved.get("fingerprint") != tokenizer["fingerprint"]:
            raise WorkdirError(
                f"workdir {workdir!r} holds a run trained with tokenizer {saved['spec']!r} "
                f"(fingerprint {saved['fingerprint']}); this config's tokenizer "
                f"{tokenizer['spec']!r} has fingerprint {tokenizer['fingerprint']}: its token "
                f"ids mean other text, so the run cannot continue under it (not even with "
                f"--resume_with_changes); expected tokenizer={saved['spec']!r}, or a new "
                f"--workdir")
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
                 resume_with_changes: bool = False, defer_write: bool = False,
                 tokenizer: dict | None = None):
    """The run's Checkpointer, holding the workdir lock (released by its ``close()``).

    defer_write: return ``(ckpt, commit, changes)`` instead, where ``commit()`` writes
    config.json and the change record: the caller calls it once the checkpoint has been
    restored under the new config, so a resume that fails (an optimizer change the saved
    state cannot follow) leaves both files as they were.

    Before any weights are built: the workdir is a writable folder, no other run holds it,
    its checkpoints are of this model and tokenizer (`check_workdir`), and a resumed run's config equals
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
        ckpt = check_workdir(workdir, model_meta, keep=cfg.train.get("keep_checkpoints", 2),
                             tokenizer=tokenizer)
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
        write_config = lead and (latest is None or changes or not os.path.isfile(path))

        def commit():
            if changes and lead:   # resumable ones too: config.json is the run's config
                with open(os.path.join(workdir, "config_changes.jsonl"), "a",
                          encoding="utf-8") as f:
                    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "from_step": latest,
                                        "changes": {k: {"from": a, "to": b}
                                                    for k, (a, b) in changes.items()}},
                                       default=str) + "\n")
            if write_config:
                _write_json(path, cfg.to_dict())
        if not defer_write:
            commit()
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    ckpt.lock = lock
    return (ckpt, commit, changes) if defer_write else ckpt
