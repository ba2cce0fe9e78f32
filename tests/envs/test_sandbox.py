"""Sandbox: normal runs, and every runaway the issue names stops fast, scores nothing, and
leaves no process behind."""
import os
import shutil
import subprocess
import time

import pytest

from opd_jax.envs.sandbox import run_many, run_python


def _gone(res):
    """No process of the run's group survives."""
    try:
        os.killpg(res.pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_plain_run_stdout_stdin_and_exit_codes():
    r = run_python("import sys, math\nprint(math.isqrt(sys.stdin.read().count('a')))",
                   stdin="a" * 49)
    assert (r.returncode, r.stdout, r.reason, r.timed_out, r.ok) == (0, "7\n", None, False,
                                                                     True)
    r = run_python("import sys; sys.exit(3)")
    assert r.returncode == 3 and r.reason is None and not r.ok
    r = run_python("raise ValueError('boom')")
    assert r.returncode == 1 and "ValueError: boom" in r.stderr and r.reason is None


def test_writes_inside_workdir_are_allowed():
    r = run_python("open('a.txt', 'w').write('hi'); print(open('a.txt').read())")
    assert r.ok and r.stdout == "hi\n"


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(60)"])
def test_infinite_loop_and_sleep_hit_wall_clock(code):
    t0 = time.monotonic()
    r = run_python(code, timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    assert r.timed_out and r.reason == "timeout" and r.returncode != 0 and not r.ok
    assert _gone(r)


def test_fork_bomb_is_stopped():
    t0 = time.monotonic()
    r = run_python("import os\nwhile True:\n    os.fork()", timeout_s=2.0)
    assert time.monotonic() - t0 < 10
    assert not r.ok and r.reason == "violation: os.fork" and _gone(r)


def test_fork_bomb_is_stopped_by_rlimits_alone():
    # Audit hook off: the unprivileged uid + RLIMIT_NPROC=1 must still refuse the fork.
    r = run_python("import os\nwhile True:\n    os.fork()", timeout_s=2.0, audit=False)
    assert not r.ok and ("BlockingIOError" in r.stderr or "Resource temporarily" in
                         r.stderr), r.stderr[-300:]
    assert _gone(r)


@pytest.mark.parametrize("code", ["import subprocess; subprocess.run(['true'])",
                                  "import os; os.system('true')",
                                  "import os; os.execv('/bin/true', ['true'])"])
def test_spawning_processes_is_blocked(code):
    r = run_python(code)
    assert not r.ok and r.reason.startswith("violation"), (r.reason, r.stderr[-200:])


@pytest.mark.parametrize("code", ["x = bytearray(8 * 1024 ** 3)", "x = [0] * (10 ** 9)",
                                  "x = ' ' * (2 ** 34)"])
def test_huge_allocation_hits_memory_limit(code):
    r = run_python(code, memory_mb=128)
    assert not r.ok and r.reason == "memory_limit", (r.reason, r.stderr[-200:])
    assert r.wall_s < 10 and _gone(r)


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/hostname", os.path.abspath(__file__)])
def test_reading_files_outside_is_blocked(path):
    r = run_python(f"print(open({path!r}).read())")
    assert not r.ok and r.reason.startswith("violation: read outside"), r.reason
    assert r.stdout == ""


def test_writing_outside_workdir_is_blocked(tmp_path):
    target = tmp_path / "pwned.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert not r.ok and r.reason.startswith("violation: write outside")
    assert not target.exists()
    r = run_python(f"import os; os.remove({str(tmp_path)!r})")
    assert not r.ok and r.reason.startswith("violation")


def test_output_is_capped():
    cap = 64 * 1024
    r = run_python("while True:\n    print('x' * 1000)", max_output_bytes=cap, timeout_s=3.0)
    assert not r.ok and r.reason == "output_limit" and len(r.stdout) <= cap
    assert not r.timed_out and _gone(r)


@pytest.mark.parametrize("code", [
    "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)",
    "import ctypes; ctypes.CDLL(None)",
])
def test_network_and_ctypes_are_blocked(code):
    r = run_python(code)
    assert not r.ok and r.reason.startswith("violation"), (r.reason, r.stderr[-200:])


@pytest.mark.skipif(os.getuid() != 0, reason="uid drop and netns need root")
def test_runs_as_nobody_in_a_private_network_namespace():
    probe = "import os; print(os.getuid(), os.getgid(), os.readlink('/proc/self/ns/net'))"
    uid, gid, net = run_python(probe).stdout.split()
    assert (uid, gid) == ("65534", "65534")
    shared = run_python(probe, network_namespace=False).stdout.split()[2]
    assert shared == os.readlink("/proc/self/ns/net")
    unshare_ok = shutil.which("unshare") and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0
    if unshare_ok:
        assert net != shared


def test_bad_arguments_raise_before_running():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("print(1)", memory_mb=1)
    with pytest.raises(TypeError, match="code must be str"):
        run_python(b"print(1)")


def test_run_many_parallel_keeps_order_and_isolates_failures():
    codes = [f"print({i} * {i})" for i in range(6)] + ["while True: pass"]
    t0 = time.monotonic()
    rs = run_many(codes, timeout_s=1.5, max_workers=7)
    # All in parallel: well under the sum of one timeout plus six starts run one by one.
    assert time.monotonic() - t0 < 8
    assert [r.stdout for r in rs[:6]] == [f"{i * i}\n" for i in range(6)]
    assert rs[6].timed_out and all(_gone(r) for r in rs)
    with pytest.raises(ValueError, match="stdins"):
        run_many(["print(1)"], stdins=["a", "b"])


@pytest.mark.slow
def test_many_parallel_runaways_all_end_and_leave_nothing():
    bad = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(10**10)",
           "while True: print('x' * 1000)", "print(open('/etc/shadow').read())"]
    codes = [bad[i % len(bad)] if i % 2 else f"print({i})" for i in range(40)]
    t0 = time.monotonic()
    rs = run_many(codes, timeout_s=1.0, max_workers=8)
    assert time.monotonic() - t0 < 60
    assert all(r.ok == (i % 2 == 0) for i, r in enumerate(rs))
    assert [r.stdout for r in rs[::2]] == [f"{i}\n" for i in range(0, 40, 2)]
    assert all(_gone(r) for r in rs)
