"""Multi-host: two local CPU processes (gloo, 4 devices each) equal one process on 8.

The child (`multihost_child.py`) runs a GRPO, a Kimi-MOPD and a DeepSeek full-vocab policy
step on a (data=2, fsdp=2, tensor=2) mesh whose data axis spans both processes, then samples
with rows sharded on that mesh; the same `run()` runs here on the 8 fake devices of
tests/conftest.py.
"""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from opd_jax import distributed
from tests.trainers import multihost_child

CHILD = os.path.join(os.path.dirname(__file__), "multihost_child.py")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT_S = float(os.environ.get("OPD_JAX_MULTIHOST_TEST_TIMEOUT", 300))
STAGES = ("init", "grpo", "kimi_mopd", "deepseek_full_vocab")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(n: int, out_dir, while_waiting, child: str = CHILD, timeout_s: float = TIMEOUT_S):
    """Run n `child` processes and, meanwhile, `while_waiting()` here; fail (killing the
    children) on an error or past `timeout_s`. Returns what `while_waiting` returned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPD_JAX_")}
    # One fake-device count per child comes from initialize(); drop the conftest's 8.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    port = _free_port()
    logs = [open(out_dir / f"child{i}.log", "w+") for i in range(n)]
    procs = [subprocess.Popen([sys.executable, child, str(i), str(n), str(port), str(out_dir)],
                              env=env, stdout=logs[i], stderr=subprocess.STDOUT, cwd=ROOT)
             for i in range(n)]
    deadline = time.monotonic() + timeout_s
    try:
        result = while_waiting()
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        text = []
        for i, f in enumerate(logs):
            f.seek(0)
            text.append(f"--- child {i} (rc {procs[i].returncode}) ---\n{f.read()[-4000:]}")
        pytest.fail("multi-process run failed or timed out after "
                    f"{timeout_s:.0f}s:\n" + "\n".join(text))
    for f in logs:
        f.close()
    return result


@pytest.mark.multiprocess
@pytest.mark.slow       # ~150 s on 2 busy cores: 3 processes compile 3 steps + sampling
def test_two_processes_equal_one_process(tmp_path):
    ref = _launch(2, tmp_path, multihost_child.run)      # the reference, meanwhile
    got = dict(np.load(tmp_path / "params.npz"))
    assert sorted(got) == sorted(ref)
    diffs = {k: float(np.max(np.abs(got[k] - ref[k]))) for k in ref}
    assert diffs["generate/tokens"] == 0
    for kind in ("params", "metrics", "generate"):
        d = {k: v for k, v in diffs.items()
             if k.split("/")[0] == kind or kind == "params" and "/" in k
             and k.split("/")[0] not in ("metrics", "generate")}
        worst = max(d, key=d.get)
        print(f"max |multi - single| over {kind}: {d[worst]:.3g} at {worst}")
    bad = {k: d for k, d in diffs.items() if d > 1e-5}
    assert not bad, f"multi-process != single-process: {bad}"
    # Every step changed the parameters.
    params = lambda stage: {k.split("/", 1)[1]: v for k, v in ref.items()   # noqa: E731
                            if k.startswith(stage + "/")}
    for before, after in zip(STAGES, STAGES[1:]):
        a, b = params(before), params(after)
        assert a.keys() == b.keys() and a
        change = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
        assert change > 1e-4, f"{after} step did not change the parameters"


def test_initialize_is_a_noop_when_nothing_is_configured(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OPD_JAX_"):
            monkeypatch.delenv(k)
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1, process_id=0) is False
    assert distributed.is_main_process()
    distributed.barrier("single")                                    # no-op
    with pytest.raises(ValueError, match="needs num_processes, process_id"):
        distributed.initialize(coordinator_address="localhost:1")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match="needs coordinator_address, process_id"):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "x")
    with pytest.raises(ValueError, match="OPD_JAX_PROCESS_ID='x': expected an integer"):
        distributed.initialize()


def test_fetch_and_put_single_process():
    import jax
    from opd_jax import sharding as sh
    mesh = sh.make_mesh((2, 2, 2))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    g = sh.put(x, sh.batch_sharding(mesh))
    assert g.sharding == sh.batch_sharding(mesh)
    out = distributed.fetch({"x": g, "s": jax.numpy.float32(2.0)})
    np.testing.assert_array_equal(out["x"], x)
    assert isinstance(out["s"], np.ndarray) and out["s"] == 2.0
