"""A run's workdir: created and checked writable (`prepare_workdir`), held by one run at a
time (`WorkdirLock`)."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class WorkdirError(ValueError):
    """A workdir cannot be used: not a folder, not writable, or held by another run."""


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
