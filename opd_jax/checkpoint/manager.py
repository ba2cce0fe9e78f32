"""Orbax checkpoints of train state + data iterator + JSON metadata, saved together.

Each step is a directory ``<workdir>/checkpoints/<step>/{state,data,meta}`` written by Orbax
to a temporary name and renamed when complete, so a run killed mid-save leaves the previous
checkpoint intact and the partial one is ignored. Resume order (big_vision's): the run's own
workdir first, then an explicit init checkpoint, then scratch.

Integrity: every save records a checksum of each array of the state (and a digest of the
data iterator's state) in its meta and refuses
a state with a non-finite float (the last good checkpoints are never rotated out by a
diverged one). Restoring the latest step verifies the checksums and finiteness; a corrupt
or unreadable latest step is moved aside to ``<step>.corrupt`` and the previous intact
step is restored, with a warning naming both. A workdir is held by one run at a time
(`opd_jax.checkpoint.lock.WorkdirLock`).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import warnings
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from opd_jax.checkpoint.digest import CheckpointError, state_digest, verify_digest
from opd_jax.checkpoint.lock import WorkdirLock
from opd_jax.checkpoint.storage import (check_space, install_late_callback_guard,
                                        install_log_filter, quiet, state_bytes, storage_error)

log = logging.getLogger(__name__)


class Checkpointer:
    """Save/restore ``(state, data iterator, meta)`` under ``directory``.

    Args:
      directory: where step folders go (created on the first save, not before).
      keep: how many recent checkpoints to keep.
      async_save: write in a background thread; `wait()` (or `close()`) blocks until done.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self._keep, self._async = keep, async_save
        self.lock: WorkdirLock | None = None     # released by close()
        self._pending: int | None = None          # the step an async save is writing
        install_log_filter()                      # a failed background save: one error
        install_late_callback_guard()
        self._mngr = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            item_names=("state", "data", "meta"),
            item_handlers={"data": grain.checkpoint.CheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self._keep, create=False, enable_async_checkpointing=self._async),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state: Any, data_iter: Any | None, meta: dict) -> None:
        """Write step `step`; refuses (CheckpointError) a state with a NaN or inf array."""
        sums, bad = state_digest(state)
        if bad:
            raise CheckpointError(
                f"refusing to write checkpoint {step} under {self.directory}: array {bad[0]} "
                f"holds NaN or inf; the earlier checkpoints {self.all_steps()} are kept")
        meta = dict(meta, checksums=sums)
        if data_iter is not None:
            meta["iterator_sha256"] = iterator_digest(data_iter)
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self.wait()       # the previous async save's failure surfaces here, as its own step
        try:
            os.makedirs(self.directory, exist_ok=True)
            check_space(self.directory, step, state_bytes(state), self.all_steps())
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise
            raise OSError(e.errno, f"writing checkpoint {step} under {self.directory}: "
                                   f"{e.strerror or e}", e.filename) from e
        self._pending = step
        with self._storage(step):
            self._mngr.save(step, args=ocp.args.Composite(**args), force=True)
        if not self._async:
            self._pending = None

    @contextlib.contextmanager
    def _storage(self, step):
        """Orbax's failure noise held back (`storage.quiet`); a failed write as one
        OSError naming the step and folder."""
        try:
            with quiet():
                yield
        except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError for I/O
            self._pending = None
            if isinstance(e, CheckpointError):
                raise
            raise storage_error(e, step, self.directory,
                                [s for s in self._safe_steps() if s != step]) from e

    def _safe_steps(self) -> list[int]:
        try:
            return self.all_steps()
        except Exception:  # noqa: BLE001
            return []

    def read_meta(self, step: int | None = None) -> dict:
        """The meta of `step`, or of the newest step whose meta is readable."""
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory!r}")
        errors = []
        for s in steps:
            try:
                with quiet():
                    return self._mngr.restore(
                        s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except Exception as e:  # noqa: BLE001 - any unreadable step: try the previous
                errors.append(f"step {s}: {_reason(e)}")
        raise CheckpointError(f"no readable checkpoint metadata under {self.directory} "
                              f"({'; '.join(errors)})")

    def _restore_one(self, step: int, abstract_state: Any, data_iter: Any | None):
        args = {"state": ocp.args.StandardRestore(abstract_state),
                "meta": ocp.args.JsonRestore()}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self._mngr.restore(step, args=ocp.args.Composite(**args))
        where = f"checkpoint {os.path.join(self.directory, str(step))}"
        verify_digest(out["state"], out["meta"], where)
        want = out["meta"].get("iterator_sha256")    # absent: saved before it was recorded
        if data_iter is not None and want is not None and iterator_digest(data_iter) != want:
            raise CheckpointError(f"{where}: the data iterator's state "
                                  f"({_state_text(data_iter)[:120]}) does not match the digest "
                                  f"recorded when it was saved (edited or corrupt data/ "
                                  f"folder)")
        return out["state"], out["meta"]

    def restore(self, step: int | None, abstract_state: Any, data_iter: Any | None = None
                ) -> tuple[Any, dict]:
        """Restore into the shapes/shardings of `abstract_state`; `data_iter` in place.

        Every array is checked against the checksum saved with it. With ``step=None`` a
        corrupt or unreadable latest step is moved aside (``<step>.corrupt``) and the
        previous one restored, with a warning naming both; an explicit step only raises."""
        if step is not None:
            try:
                with quiet():
                    return self._restore_one(step, abstract_state, data_iter)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"checkpoint {os.path.join(self.directory, str(step))} "
                                      f"is unreadable: {_reason(e)}") from e
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory!r}")
        errors = []
        for i, s in enumerate(steps):
            try:
                with quiet():      # a corrupt step's read noise: the warning says it
                    out = self._restore_one(s, abstract_state, data_iter)
            except Exception as e:  # noqa: BLE001 - corrupt data, metadata or checksum
                errors.append((s, _reason(e)))
                continue
            if errors:
                moved = self._quarantine([b for b, _ in errors])
                warnings.warn(f"checkpoint step {errors[0][0]} under {self.directory} is "
                              f"corrupt or unreadable ({errors[0][1]}); resumed from the "
                              f"previous intact step {s} (the corrupt one moved aside to "
                              f"{', '.join(moved)})", RuntimeWarning, stacklevel=2)
            return out
        raise CheckpointError(f"no intact checkpoint under {self.directory}: "
                              + "; ".join(f"step {s}: {r}" for s, r in errors))

    def _quarantine(self, steps: list[int]) -> list[str]:
        """Rename corrupt step folders to ``<step>.corrupt`` (kept, never deleted) so the
        resumed run can write those steps again."""
        if jax.process_count() > 1:
            raise CheckpointError(f"checkpoint steps {steps} under {self.directory} are "
                                  f"corrupt; move them aside and restart (multi-process runs "
                                  f"do not rename checkpoints)")
        self._mngr.wait_until_finished()
        self._mngr.close()
        moved = []
        for s in steps:
            src = os.path.join(self.directory, str(s))
            dst, n = f"{src}.corrupt", 1
            while os.path.exists(dst):
                dst, n = f"{src}.corrupt{n}", n + 1
            os.rename(src, dst)
            moved.append(dst)
        self._mngr = self._manager()
        return moved

    def wait(self) -> None:
        """Block until the async save is written; its failure raised as one OSError."""
        with self._storage(self._pending):
            self._mngr.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        try:
            self.wait()
            self._mngr.close()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None


def _state_text(data_iter) -> str:
    state = data_iter.get_state()
    if isinstance(state, bytes):
        return state.decode("utf-8", "replace")
    return json.dumps(state, sort_keys=True, default=str)


def iterator_digest(data_iter) -> str:
    """sha256 of a data iterator's state (what its checkpoint's data/ folder restores), so a
    resume on other data is caught like a corrupt array."""
    return hashlib.sha256(_state_text(data_iter).encode("utf-8")).hexdigest()


def _reason(e: BaseException) -> str:
    """A one-line reason for a failed read (the exception type and the first line)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for `restore`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def step_dirs(path: str | os.PathLike) -> list[str]:
    """The step folders of a run workdir or its ``checkpoints/`` folder, oldest first (a
    step folder: itself)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(os.path.join(path, "state")):
        return [path]
    ckdir = os.path.join(path, "checkpoints") if os.path.isdir(
        os.path.join(path, "checkpoints")) else path
    steps = sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) if os.path.isdir(ckdir) else []
    return [os.path.join(ckdir, str(s)) for s in steps]


def latest_step_dir(path: str | os.PathLike) -> str:
    """Resolve a run workdir, its ``checkpoints/`` folder, or a step folder to a step folder."""
    dirs = step_dirs(path)
    if not dirs:
        raise FileNotFoundError(f"no Orbax checkpoint under {os.path.abspath(os.fspath(path))!r} "
                                f"(expected a run workdir, its checkpoints/ folder, or a step "
                                f"folder)")
    return dirs[-1]


def read_step_meta(step_dir: str) -> dict:
    """The JSON meta of a step folder (read through Orbax's JSON handler)."""
    return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
        os.path.join(step_dir, "meta"), args=ocp.args.JsonRestore())


def restore_params(step_dir: str, abstract_params: Any, shardings: Any | None = None) -> Any:
    """Restore only ``params`` of a saved TrainState (no optimizer state is read)."""
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, abstract_params)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), shardings)
    try:
        with quiet():      # a corrupt step's read noise: the error says it
            out = ocp.PyTreeCheckpointer().restore(
                os.path.join(step_dir, "state"),
                args=ocp.args.PyTreeRestore(item={"params": abstract_params},
                                            restore_args={"params": restore_args},
                                            partial_restore=True))
    except Exception as e:  # noqa: BLE001 - corrupt or truncated data: one line naming it
        raise CheckpointError(f"checkpoint {step_dir} is unreadable: {_reason(e)}") from e
    meta = read_step_meta(step_dir) if os.path.isdir(os.path.join(step_dir, "meta")) else {}
    verify_digest(out["params"], meta, f"checkpoint {step_dir}", prefix=".params")
    return out["params"]
