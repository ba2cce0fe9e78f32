"""The persistent compilation cache the CLI turns on: a second process reads the program
back instead of compiling it; OPD_JAX_COMPILATION_CACHE=0 leaves it off."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHILD = r"""
import jax, jax.numpy as jnp, time
from opd_jax import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda e, **k: hits.append(e) if e.endswith("cache_hits") else None)
print("dir", compile_cache.enable())
def f(x):                      # a program slow enough to compile (> MIN_COMPILE_SECONDS)
    for i in range(60):
        x = jnp.sin(x @ x.T + i) @ x
    return x
jax.block_until_ready(jax.jit(f)(jnp.ones((64, 64))))
print("hits", len(hits))
"""


def _run(env_value, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    if env_value is None:
        env.pop("OPD_JAX_COMPILATION_CACHE", None)
    else:
        env["OPD_JAX_COMPILATION_CACHE"] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    return lines["dir"], int(lines["hits"])


def test_second_process_reads_the_program_back(tmp_path):
    cache = tmp_path / "cache"
    d1, hits1 = _run(str(cache), tmp_path)
    assert d1 == str(cache) and hits1 == 0 and any(cache.iterdir())
    d2, hits2 = _run(str(cache), tmp_path)
    assert hits2 >= 1


def test_default_dir_and_off_switch(tmp_path):
    d, _ = _run(None, tmp_path)
    assert d == str(tmp_path / "xdg" / "opd_jax" / "xla") and any(os.scandir(d))
    d, hits = _run("0", tmp_path)
    assert d == "None" and hits == 0
