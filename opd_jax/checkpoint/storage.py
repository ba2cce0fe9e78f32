"""Storage failures of Orbax writes and reads, as one clean error instead of dozens of
tracebacks.

* `check_space`: before a checkpoint is written, the folder's free space must hold the
  state's bytes (a disk that cannot fits it fails before Orbax starts writing, naming the
  step, the folder, the bytes needed and free).
* `storage_error`: a write that still fails with "no space left" (another process filled
  the disk meanwhile) becomes ``OSError(ENOSPC, ...)`` naming the step and folder.
* `quiet`: around an Orbax call that may fail, the C++ callbacks' "Event loop is closed"
  tracebacks and Orbax's ERROR logs (printed straight to file descriptor 2, dozens per
  failure) are held back; they are written out only when the call succeeds (nothing is
  lost) and dropped when it fails, since the error raised then says what happened.
* `install_log_filter`: Orbax's ERROR records of a failed background save (absl's logger,
  asyncio's "Task exception was never retrieved") are dropped: the failure is raised by
  the next save or close, as one error.
* `install_late_callback_guard`: when one write of a save fails, Orbax closes its event loop
  while tensorstore's other writes are still in flight; each of them later calls
  ``loop.call_soon_threadsafe`` from a native thread and tensorstore prints the
  "Event loop is closed" traceback (11 to 144 of them per failure, at any later time). A
  call into a closed loop made straight from native code (no Python caller) is dropped
  instead; every other call behaves as before.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import sys
import tempfile

import jax

NO_SPACE = ("No space left on device", "os_error_code='28'", "ENOSPC")


def format_bytes(n: float) -> str:
    """Bytes for a message: "195.3 KiB", "33.4 GiB", "2.0 TiB"."""
    for unit, size in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2),
                       ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def state_bytes(state) -> int:
    """Bytes this process writes for `state` (its addressable shards)."""
    total = 0
    for leaf in jax.tree.leaves(state):
        shards = getattr(leaf, "addressable_shards", None)
        if shards is not None:
            total += sum(s.data.nbytes for s in shards if s.replica_id == 0)
        else:
            total += getattr(leaf, "nbytes", 0)
    return total


def check_space(directory: str, step: int, need: int, kept: list[int]) -> None:
    free = shutil.disk_usage(directory).free
    if free < need + (1 << 20):
        raise OSError(errno.ENOSPC, f"writing checkpoint {step} under {directory}: no space "
                                    f"left: it needs {format_bytes(need)} and the disk has "
                                    f"{format_bytes(free)} free; the earlier checkpoints {kept} are "
                                    f"kept. Free some space (or use another --workdir) and "
                                    f"re-run to resume", directory)


def is_no_space(e: BaseException) -> bool:
    return getattr(e, "errno", None) == errno.ENOSPC or any(s in str(e) for s in NO_SPACE)


def storage_error(e: BaseException, step, directory: str, kept: list[int]) -> OSError:
    """A write failure as one OSError naming the step and folder (the partial step's
    temporary folder removed: Orbax never renamed it into place)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(f"{step}.orbax-checkpoint-tmp"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    if is_no_space(e):
        return OSError(errno.ENOSPC, f"writing checkpoint {step} under {directory}: no space "
                                     f"left on device; the earlier checkpoints {kept} are "
                                     f"kept. Free some space (or use another --workdir) and "
                                     f"re-run to resume", directory)
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return OSError(getattr(e, "errno", None) or errno.EIO,
                   f"writing checkpoint {step} under {directory}: {type(e).__name__}: {first}; "
                   f"the earlier checkpoints {kept} are kept", directory)


@contextlib.contextmanager
def quiet():
    """Hold back what is written to fd 2 inside; write it out unless an exception leaves."""
    if os.environ.get("OPD_JAX_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    tmp = tempfile.TemporaryFile()
    os.dup2(tmp.fileno(), 2)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if not failed:
            tmp.seek(0)
            text = tmp.read()
            if text:
                os.write(2, text)
        tmp.close()


class _OrbaxFailureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        msg = record.getMessage()
        if "orbax" in record.pathname or "Task exception was never retrieved" in msg:
            return False
        return not any(s in msg for s in NO_SPACE)


_FILTER = _OrbaxFailureFilter()


def install_log_filter() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


_ORIGINAL_CALL_SOON_THREADSAFE = asyncio.BaseEventLoop.call_soon_threadsafe


def _call_soon_threadsafe(self, callback, *args, context=None):
    if self.is_closed():
        try:
            sys._getframe(1)        # a Python caller: the usual error
        except ValueError:          # native code (tensorstore's done-callback): drop it
            return None
    return _ORIGINAL_CALL_SOON_THREADSAFE(self, callback, *args, context=context)


def install_late_callback_guard() -> None:
    asyncio.BaseEventLoop.call_soon_threadsafe = _call_soon_threadsafe
