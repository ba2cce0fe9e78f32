"""Orbax checkpoints of train state + data iterator + JSON metadata, saved together.

Each step is a directory ``<workdir>/checkpoints/<step>/{state,data,meta}`` written by Orbax
to a temporary name and renamed when complete, so a run killed mid-save leaves the previous
checkpoint intact and the partial one is ignored. Resume order (big_vision's): the run's own
workdir first, then an explicit init checkpoint, then scratch.

Integrity: every save records a checksum of each array of the state in its meta and refuses
a state with a non-finite float (the last good checkpoints are never rotated out by a
diverged one). Restoring the latest step verifies the checksums and finiteness; a corrupt
or unreadable latest step is moved aside to ``<step>.corrupt`` and the previous intact
step is restored, with a warning naming both. A workdir is held by one run at a time
(:class:`WorkdirLock`).
"""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import socket
import time
import warnings
from typing import Any

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read back intact; the message names the step and
    the array or file."""


class WorkdirError(ValueError):
    """A workdir cannot be used: not a folder, not writable, or held by another run."""


# Elements per block of `_leaf_digest`: its temporaries (the uint32 words and weights) are
# bounded by a block, not by the array. Whole-array uint32 temporaries of every leaf at once
# were 4.4 GiB for a train state holding a 151k x 2048 embedding and its two Adam moments.
DIGEST_BLOCK = 1 << 22


def _block_digest(x: jax.Array, start, dtype) -> tuple[jax.Array, jax.Array]:
    """(checksum, all-finite) of a flat block whose first element is at `start`: `x` holds
    the values of an array of `dtype`, or, for dtypes narrower than 4 bytes, their bits."""
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    elif x.dtype.itemsize >= 4:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)    # 8-byte dtypes: a trailing [2]
    else:
        u = x.astype(jnp.uint32)                           # uint16 / uint8 bits
    u = u.reshape(-1)
    per = u.size // x.size if x.size else 1               # uint32 words per element
    pos = jnp.asarray(start, jnp.uint32) * jnp.uint32(per) + jnp.arange(u.size,
                                                                         dtype=jnp.uint32)
    digest = jnp.sum((u ^ (u >> 15)) * (pos * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)),
                     dtype=jnp.uint32)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return digest, jnp.asarray(True)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (2, 4):
        fi = jnp.finfo(dtype)           # finite: the exponent bits are not all ones
        exponent = jnp.uint32(((1 << fi.nexp) - 1) << fi.nmant)
        return digest, jnp.all((u & exponent) != exponent)
    values = x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)
    return digest, jnp.all(jnp.isfinite(values))


@functools.partial(jax.jit, static_argnames="block")
def _leaf_digest(x: jax.Array, block: int = DIGEST_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(uint32 position-weighted checksum of the raw bits, all-finite flag) of one array.

    Computed `block` elements at a time (a loop over dynamic slices), so its temporaries
    are a block's whatever the array's size (plus, for dtypes narrower than 4 bytes, one copy
    of the array's bits: sliced as bf16, XLA's CPU backend would carry the array through the
    loop widened to float32). The value is the whole-array sum: a wrapping uint32 sum of
    per-position terms does not depend on how it is split. One jit call per array, so only
    one array's temporaries are live at a time."""
    block = max(1, int(block))
    flat = x.reshape(-1)
    if x.dtype.itemsize < 4 and x.dtype != jnp.bool_:
        flat = jax.lax.bitcast_convert_type(flat, {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize])
    n = flat.size
    full = n // block if n > block else 0
    digest, finite = jnp.uint32(0), jnp.asarray(True)
    if full:
        def body(i, carry):
            d, f = carry
            start = i.astype(jnp.uint32) * jnp.uint32(block)
            bd, bf = _block_digest(jax.lax.dynamic_slice(flat, (i * block,), (block,)), start,
                                   x.dtype)
            return d + bd, f & bf
        digest, finite = jax.lax.fori_loop(0, full, body, (digest, finite))
    if n - full * block or not full:
        bd, bf = _block_digest(flat[full * block:], full * block, x.dtype)
        digest, finite = digest + bd, finite & bf
    return digest, finite


def state_digest(tree: Any, prefix: str = "") -> tuple[dict[str, int], list[str]]:
    """({array path: checksum}, [paths of arrays holding a NaN or inf]) of a pytree.

    The checksum is a wrapping uint32 sum, so it is exact whatever the reduction order
    (sharded or not, any mesh).

    Multi-process, the arrays are digested one at a time (`distributed.settle`: many small
    multi-device programs in flight at once deadlock under gloo;
    tests/trainers/test_multihost_policy.py saves through it)."""
    from opd_jax.distributed import fetch, settle
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [prefix + jax.tree_util.keystr(p) for p, _ in flat]
    out = fetch([settle(_leaf_digest(jnp.asarray(x))) for _, x in flat])
    sums = {n: int(d) for n, (d, _) in zip(names, out)}
    return sums, [n for n, (_, ok) in zip(names, out) if not bool(ok)]


def verify_digest(tree: Any, meta: dict, where: str, prefix: str = "") -> None:
    """Raise CheckpointError unless every array of `tree` is finite and matches the
    checksum recorded in `meta` (checkpoints written before checksums: finiteness only)."""
    sums, bad = state_digest(tree, prefix)
    if bad:
        raise CheckpointError(f"{where}: array {bad[0]} holds NaN or inf"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    saved = meta.get("checksums")
    if saved:
        wrong = [n for n, v in sums.items() if n in saved and saved[n] != v]
        missing = [n for n in sums if n not in saved]
        if wrong or missing:
            name = (wrong or missing)[0]
            raise CheckpointError(f"{where}: array {name} does not match the checksum "
                                  f"recorded when it was saved ({saved.get(name)} != "
                                  f"{sums[name]}); its bytes are corrupt")


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
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._mngr.save(step, args=ocp.args.Composite(**args), force=True)
        except OSError as e:
            raise OSError(e.errno, f"writing checkpoint {step} under {self.directory}: "
                                   f"{e.strerror or e}", e.filename) from e

    def read_meta(self, step: int | None = None) -> dict:
        """The meta of `step`, or of the newest step whose meta is readable."""
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory!r}")
        errors = []
        for s in steps:
            try:
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
        verify_digest(out["state"], out["meta"],
                      f"checkpoint {os.path.join(self.directory, str(step))}")
        return out["state"], out["meta"]

    def restore(self, step: int | None, abstract_state: Any, data_iter: Any | None = None
                ) -> tuple[Any, dict]:
        """Restore into the shapes/shardings of `abstract_state`; `data_iter` in place.

        Every array is checked against the checksum saved with it. With ``step=None`` a
        corrupt or unreadable latest step is moved aside (``<step>.corrupt``) and the
        previous one restored, with a warning naming both; an explicit step only raises."""
        if step is not None:
            try:
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
        self._mngr.wait_until_finished()

    def close(self) -> None:
        try:
            self._mngr.wait_until_finished()
            self._mngr.close()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None


def _reason(e: BaseException) -> str:
    """A one-line reason for a failed read (the exception type and the first line)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def prepare_workdir(workdir: str) -> str:
    """Create `workdir` if needed and check it is a writable folder (before any work)."""
    workdir = os.path.abspath(os.fspath(workdir))
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise WorkdirError(f"workdir {workdir!r} is a file, not a folder; give a folder path")
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_probe.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"workdir {workdir!r} is not writable ({e.strerror or e}); "
                           f"give a folder you can write to") from None
    return workdir


class WorkdirLock:
    """An exclusive lock on a workdir: ``<workdir>/run.lock`` held with ``flock``.

    The file records the holder's pid, host and start time. The kernel drops the lock
    when its holder dies (even by SIGKILL), so a lock left by a dead run is stale and is
    taken over (with a warning); one held by a live run is refused naming the holder.
    Within one process the lock is re-entrant (a failed call may be retried)."""

    _held: dict[str, list] = {}     # path -> [fd, count]: this process's locks

    def __init__(self, workdir: str):
        self.path = os.path.join(os.path.abspath(workdir), "run.lock")
        self._released = False
        if self.path in WorkdirLock._held:
            WorkdirLock._held[self.path][1] += 1
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirError(
                f"workdir {os.path.dirname(self.path)!r} is in use by another run "
                f"(pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since "
                f"{holder.get('started', '?')}; lock file {self.path}); wait for it to end "
                f"or use another --workdir") from None
        previous = _read_holder(fd)
        if previous.get("pid") and not previous.get("released"):
            log.warning("taking over the stale lock %s of pid %s on %s (that run is gone)",
                        self.path, previous.get("pid"), previous.get("host"))
        _write_holder(fd, {"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        WorkdirLock._held[self.path] = [fd, 1]

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        entry = WorkdirLock._held[self.path]
        entry[1] -= 1
        if entry[1] == 0:
            del WorkdirLock._held[self.path]
            _write_holder(entry[0], {**_read_holder(entry[0]), "released": True})
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}


def _write_holder(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode())


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for `restore`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def latest_step_dir(path: str | os.PathLike) -> str:
    """Resolve a run workdir, its ``checkpoints/`` folder, or a step folder to a step folder."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(os.path.join(path, "state")):
        return path
    ckdir = os.path.join(path, "checkpoints") if os.path.isdir(
        os.path.join(path, "checkpoints")) else path
    steps = sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) if os.path.isdir(ckdir) else []
    if not steps:
        raise FileNotFoundError(f"no Orbax checkpoint under {path!r} (expected a run workdir, "
                                f"its checkpoints/ folder, or a step folder)")
    return os.path.join(ckdir, str(steps[-1]))


def read_step_meta(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "meta", "metadata"), encoding="utf-8") as f:
        return json.load(f)


def restore_params(step_dir: str, abstract_params: Any, shardings: Any | None = None) -> Any:
    """Restore only ``params`` of a saved TrainState (no optimizer state is read)."""
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, abstract_params)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), shardings)
    out = ocp.PyTreeCheckpointer().restore(
        os.path.join(step_dir, "state"),
        args=ocp.args.PyTreeRestore(item={"params": abstract_params},
                                    restore_args={"params": restore_args},
                                    partial_restore=True))
    meta = read_step_meta(step_dir) if os.path.isfile(
        os.path.join(step_dir, "meta", "metadata")) else {}
    verify_digest(out["params"], meta, f"checkpoint {step_dir}", prefix=".params")
    return out["params"]
