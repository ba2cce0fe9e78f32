"""Sandbox child: locks the process down, then runs untrusted code. Started by sandbox.py.

Runs as `python -I -S -B _sandbox_child.py WORKDIR CONFIG_JSON` with cwd=WORKDIR. Order:
preload allowed modules (the interpreter may live where an unprivileged user cannot read),
leave the network namespace, set rlimits, drop to uid/gid 65534 when root, install an audit
hook, then exec WORKDIR/main.py. Nothing from the outside package is imported: this file
must run under `-S` with the standard library only.

Layers, each stopping a runaway on its own: rlimits (CPU seconds, address space, file size
= output cap, open files, processes), unprivileged uid (root ignores RLIMIT_NPROC), a private
network namespace when the kernel allows it, and an audit hook that kills the process on
fork/exec/socket/ctypes or a write outside WORKDIR. The parent adds the wall-clock kill.
"""
import json
import os
import sys
import types

# Exit codes read by the parent (sandbox.py keeps the same numbers).
EXIT_VIOLATION = 113
EXIT_MEMORY = 114
VIOLATION_MARK = "__SANDBOX_VIOLATION__"

# Imported up front: after the uid drop, the stdlib may be unreadable (e.g. under /root).
PRELOAD = (  # kept lean: every run pays for these (inspect-heavy ones like dataclasses not)
    "math", "itertools", "functools", "collections", "collections.abc", "re", "string",
    "heapq", "bisect", "random", "operator", "copy", "traceback", "linecache", "io", "time",
)
BLOCKED_EVENTS = (
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "os.kill", "os.killpg", "os.setuid", "os.chroot", "pty.spawn",
    "socket.", "ctypes.", "mmap.", "sys.setprofile", "sys.settrace", "sys.addaudithook",
    "os.chmod", "os.chown", "os.link", "os.symlink", "os.startfile", "webbrowser.open",
    "_posixsubprocess",
)
BLOCKED_IMPORTS = frozenset({
    "ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess",
    "multiprocessing", "_multiprocessing", "pty", "mmap", "signal", "_signal", "resource",
    "ssl", "_ssl", "select", "selectors", "asyncio", "threading", "_thread", "fcntl",
})
PATH_EVENTS = ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.truncate", "shutil.")
CLONE_NEWNET = 0x40000000
NOBODY = 65534


def _violation(what):
    os.write(2, f"\n{VIOLATION_MARK} {what}\n".encode("ascii", "replace"))
    os._exit(EXIT_VIOLATION)


def _inside(path, root):
    if isinstance(path, int):  # an already-open fd: its open() was checked
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == root or real.startswith(root + os.sep)


def _make_hook(workdir, read_roots):
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and not _inside(path, workdir):
                _violation(f"write outside workdir: {path!r}")
            if not writing and not any(_inside(path, r) for r in read_roots):
                _violation(f"read outside workdir: {path!r}")
        elif event == "import":
            name = args[0] or ""
            if name.split(".")[0] in BLOCKED_IMPORTS:
                _violation(f"import {name}")
        elif event.startswith(BLOCKED_EVENTS):
            _violation(event)
        elif event.startswith(PATH_EVENTS):
            for p in args:
                if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p, workdir):
                    _violation(f"{event} outside workdir: {p!r}")
    return hook


def _lock_down(workdir, cfg):
    import resource   # lazy: the sandboxed child's limits, set before user code runs
    import signal     # lazy: as above
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; we want the kill
    if cfg["net"] and os.getuid() == 0:
        try:  # private, empty network namespace; needs CAP_SYS_ADMIN (root)
            import ctypes  # lazy: user code must not find it among this module's globals
            ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET)
        except Exception:
            pass  # the audit hook still blocks sockets
    mb = 1 << 20
    limits = {
        resource.RLIMIT_CPU: (cfg["cpu_s"], cfg["cpu_s"] + 1),
        resource.RLIMIT_AS: (cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
        resource.RLIMIT_FSIZE: (cfg["max_output_bytes"], cfg["max_output_bytes"]),
        resource.RLIMIT_NOFILE: (32, 32),
        resource.RLIMIT_CORE: (0, 0),
    }
    if os.getuid() == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        except OSError:
            pass  # a container without CAP_SETUID: the audit hook still blocks forks
    for which, lim in limits.items():
        resource.setrlimit(which, lim)
    # Counted per real uid: 1 means "no new processes or threads" for this uid.
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))


def main():
    workdir, cfg = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2])
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    import traceback   # lazy: only the child's error path reads it
    src_path = os.path.join(workdir, "main.py")
    with open(src_path) as f:
        code = compile(f.read(), src_path, "exec")
    _lock_down(workdir, cfg)
    read_roots = [workdir] + [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
    if cfg["audit"]:
        # Forget blocked modules we used ourselves, so that importing them again is an
        # import event the hook sees.
        for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED_IMPORTS]:
            del sys.modules[name]
        sys.addaudithook(_make_hook(workdir, read_roots))
    # Tell the parent the lock-down is done: its wall clock for user code starts now.
    os.write(cfg["ready_fd"], b"R")
    os.close(cfg["ready_fd"])
    user_main = types.ModuleType("__main__")
    user_main.__file__ = src_path
    sys.modules["__main__"] = user_main  # hide this module (and its helpers) from user code
    try:
        exec(code, user_main.__dict__)
    except SystemExit:
        raise
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(EXIT_MEMORY)
    except BaseException as e:
        # Skip this file's own frame: its source may be unreadable after the uid drop.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.stdout.flush()
        sys.exit(1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
