"""The notebooks under notebooks/ are stored without outputs and execute top to bottom.

Each notebook runs in a fresh python3 kernel (the one of this interpreter), with the
notebook's folder as working directory (as `jupyter lab notebooks/` does), the repository
on PYTHONPATH, MPLBACKEND=Agg and one CPU device (the suite's 8 fake devices are removed).
"""
import os
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")     # provides the python3 kernel the notebooks run in

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
ALL = sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb"))


def kernel_env() -> dict:
    """This process's environment for the kernel, minus the suite's fake-device flag."""
    env = dict(os.environ, MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def execute(name: str, timeout: int = 900):
    """Run notebooks/<name> in a fresh kernel; returns (executed notebook, seconds)."""
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOKS}})
    t0 = time.perf_counter()
    client.execute(env=kernel_env())
    return nb, time.perf_counter() - t0


def test_notebooks_exist():
    assert ALL == ["01_objectives.ipynb", "02_kernels.ipynb", "03_tiny_mopd.ipynb"]


@pytest.mark.parametrize("name", ALL)
def test_stored_without_outputs(name):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name} cell {i} has stored outputs"
            assert cell.execution_count is None, f"{name} cell {i} has an execution count"


def _check_ran(nb, name):
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{name}: a cell did not run"
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert images >= 1, f"{name}: no figure was displayed"


@pytest.mark.parametrize("name", [
    "01_objectives.ipynb",
    "02_kernels.ipynb",
    pytest.param("03_tiny_mopd.ipynb", marks=[pytest.mark.slow, pytest.mark.long]),
])
def test_notebook_executes(name):
    # 03 runs the main job in miniature (two specialist SFTs, a merge, 60 OPD iterations at
    # max effort) and rewrites notebooks/results/03_tiny_mopd.{json,md} (its wall time is in
    # there): tens of minutes beside the slow tier's other worker, so it is `long`.
    nb, seconds = execute(name, timeout=2400 if name.startswith("03") else 900)
    _check_ran(nb, name)
    print(f"{name}: {seconds:.1f} s")
