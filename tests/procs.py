"""Child processes in tests: SIGKILL one at the moment a condition holds."""
import signal
import time


def sigkill_when(proc, ready, *, timeout: float, poll: float = 0.02) -> None:
    """SIGKILL `proc` once `ready()` holds (or `timeout` seconds pass); fails if it ends
    first. The child is always reaped and its stderr pipe (if any) closed."""
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None and not ready():
            time.sleep(poll)
        err = proc.stderr.read()[-2000:] if proc.poll() is not None and proc.stderr else ""
        assert proc.poll() is None, f"child ended early: {err}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
