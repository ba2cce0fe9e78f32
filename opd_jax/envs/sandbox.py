"""Run untrusted Python in a separate, locked-down process; never hang or crash the caller.

    res = run_python("print(sum(range(10)))", timeout_s=2.0)
    res.stdout == "45\\n"; res.ok is True; res.reason is None

Each run gets a fresh temp dir (its cwd, the only place it may write), a wall-clock limit
that kills the whole process group, a CPU-seconds rlimit, an address-space limit, an output
cap (RLIMIT_FSIZE on the files stdout/stderr go to, so a print loop dies at the cap), no
new processes (uid 65534 when started as root, RLIMIT_NPROC=1, and an audit hook), no
network (a private network namespace when permitted, and the hook blocks sockets), and no
reads outside the temp dir and the standard library. The lock-down itself is in
`_sandbox_child.py`. `run_many` runs several programs in parallel from a thread pool (plain
Popen, no preexec_fn, so it is safe next to other threads).

`reason` says why the sandbox stopped a program: "timeout", "cpu_limit", "memory_limit",
"output_limit", "violation: <what>", or "killed: signal N"; it is None when the program ran
to its own end (its returncode may still be non-zero, e.g. an exception).

Limit: the audit hook is a tripwire, not a security boundary (PEP 578); the boundary is the
unprivileged uid, the rlimits and the namespace. Modules the standard library does not
preload may be unimportable when the interpreter sits in a directory uid 65534 cannot read.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
# Kept equal to the constants in _sandbox_child.py (that file imports nothing from here).
EXIT_VIOLATION = 113
EXIT_MEMORY = 114
VIOLATION_MARK = "__SANDBOX_VIOLATION__"
NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run. `reason` is None unless the sandbox stopped it."""
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    reason: str | None
    wall_s: float
    pid: int = -1  # also the process-group id; gone once run_python returns

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.reason is None


def _check_args(timeout_s, memory_mb, max_output_bytes):
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 600):
        raise ValueError(f"timeout_s={timeout_s!r}: expected a number in (0, 600]")
    if not (isinstance(memory_mb, int) and 32 <= memory_mb <= 65536):
        raise ValueError(f"memory_mb={memory_mb!r}: expected an int in [32, 65536]")
    if not (isinstance(max_output_bytes, int) and 1024 <= max_output_bytes <= 1 << 30):
        raise ValueError(f"max_output_bytes={max_output_bytes!r}: expected an int in "
                         f"[1024, 2**30]")


def _read_capped(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", "replace")


def _reason(rc: int, stderr: str, timed_out: bool) -> str | None:
    if timed_out:
        return "timeout"
    if rc == EXIT_VIOLATION and VIOLATION_MARK in stderr:
        return "violation: " + stderr.rsplit(VIOLATION_MARK, 1)[1].strip()
    if rc == EXIT_MEMORY:
        return "memory_limit"
    if rc == -signal.SIGXCPU:
        return "cpu_limit"
    if rc == -signal.SIGXFSZ:
        return "output_limit"
    if rc < 0:
        return f"killed: signal {-rc}"
    if rc != 0 and stderr.rstrip().endswith("MemoryError"):
        return "memory_limit"
    return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, *, stdin: str = "", timeout_s: float = 2.0, memory_mb: int = 256,
               max_output_bytes: int = 1 << 20, network_namespace: bool = True,
               audit: bool = True, startup_timeout_s: float = 10.0) -> SandboxResult:
    """Run `code` as __main__ in a sandboxed `python -I -S`; see the module docstring.

    `timeout_s` is the wall-clock limit for the user's code, counted from the moment the
    sandbox is locked down (interpreter start, ~0.1 s, has `startup_timeout_s` of its own,
    so a busy machine does not fail fast programs); CPU time is capped at
    ceil(timeout_s) + 1 s. `audit=False` turns off the audit hook (tests use it to show that
    the rlimits/uid alone still stop a fork bomb); leave it on otherwise.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    _check_args(timeout_s, memory_mb, max_output_bytes)
    workdir = tempfile.mkdtemp(prefix="opd_sandbox_")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        out_path, err_path, in_path = (os.path.join(workdir, n) for n in
                                       (".stdout", ".stderr", ".stdin"))
        with open(in_path, "w") as f:
            f.write(stdin)
        if os.getuid() == 0:  # the child drops to nobody and must own its cwd
            for p in (out_path, err_path):
                open(p, "w").close()
            for p in (workdir, out_path, err_path):
                os.chown(p, NOBODY, NOBODY)
        ready_r, ready_w = os.pipe()
        # CPU: the user's seconds plus the interpreter start (which runs before the limit
        # applies only in part); the wall clock below is the tight limit.
        cfg = {"cpu_s": int(math.ceil(timeout_s)) + 1, "memory_mb": memory_mb,
               "max_output_bytes": max_output_bytes, "net": network_namespace,
               "audit": audit, "ready_fd": ready_w}
        cmd = [sys.executable, "-I", "-S", "-B", _CHILD, workdir, json.dumps(cfg)]
        t0 = time.monotonic()
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout, \
                open(err_path, "wb") as ferr:
            try:
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                                        cwd=workdir, pass_fds=(ready_w,),
                                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                        start_new_session=True, close_fds=True)
            except BaseException:
                os.close(ready_r)
                raise
            finally:
                os.close(ready_w)
            timed_out = False
            try:
                # Start-up (imports, lock-down) gets its own generous limit, so a loaded
                # machine does not eat the program's time; EOF means it exited early.
                poll = select.poll()  # not select(): fds above 1024 are common in trainers
                poll.register(ready_r, select.POLLIN | select.POLLHUP)
                if not poll.poll(startup_timeout_s * 1000):
                    raise subprocess.TimeoutExpired(cmd, startup_timeout_s)
                os.read(ready_r, 1)
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                rc = proc.wait()
            finally:
                # Strays (none expected: forks are blocked) die with the group, also when
                # the caller is interrupted mid-wait.
                _kill_group(proc.pid)
                os.close(ready_r)
        wall = time.monotonic() - t0
        stdout = _read_capped(out_path, max_output_bytes)
        stderr = _read_capped(err_path, max_output_bytes)
        return SandboxResult(rc, stdout, stderr, timed_out, _reason(rc, stderr, timed_out),
                             wall, proc.pid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_many(codes: Sequence[str], *, stdins: Sequence[str] | None = None,
             max_workers: int | None = None, **kwargs) -> list[SandboxResult]:
    """`run_python` over many programs in parallel (threads; each run is its own process).

    >>> [r.stdout for r in run_many(["print(1)", "print(2)"])]
    ['1\\n', '2\\n']
    """
    stdins = [""] * len(codes) if stdins is None else list(stdins)
    if len(stdins) != len(codes):
        raise ValueError(f"len(stdins)={len(stdins)} != len(codes)={len(codes)}")
    workers = max_workers or min(8, max(1, os.cpu_count() or 1) * 2)
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(codes))) as pool:
        return list(pool.map(lambda cs: run_python(cs[0], stdin=cs[1], **kwargs),
                             zip(codes, stdins)))
