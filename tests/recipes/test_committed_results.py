"""The committed results tables are what the report code writes from the committed
results.json: no number or PASS/FAIL in them is typed by hand."""
import json
import os

import pytest

from opd_jax.recipes import recipe_module
from studies import student_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# (recipe, results folder, seeds): every committed results table
COMMITTED = [("kimi_k3", "results", [0, 1, 2]), ("kimi_k3", "mixed_reduced", [0, 1, 2]),
             ("kimi_k3", "full", [0, 1, 2]),
             ("glm", "results", [0, 1, 2]),
             ("deepseek_v4", "results", [0, 1, 2]), ("real_smollm2", "results", [0])]


@pytest.mark.parametrize("recipe,where,seeds", COMMITTED)
def test_results_md_is_regenerated_from_results_json(recipe, where, seeds, tmp_path):
    folder = os.path.join(ROOT, "experiments", recipe, where)
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    out = tmp_path / "results.md"
    mod = recipe_module(recipe)
    mod.write_markdown(str(out), results)
    with open(os.path.join(folder, "results.md"), encoding="utf-8") as f:
        assert out.read_text() == f.read()
    # the claims in the JSON are the report's function of the JSON alone
    assert mod.claims(results) == results["claims"]
    prov = results["provenance"]
    assert prov["commit"] != "unknown" and prov["stages_wall_s"] > 0
    assert results["seeds"] == seeds


SWEEPS = sorted(d for d in os.listdir(os.path.join(ROOT, "experiments", "kimi_k3"))
                if d.startswith("student_sweep"))


def _results(folder: str) -> tuple[dict, str]:
    """A committed experiment folder's results.json (parsed) and results.md (text)."""
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    with open(os.path.join(folder, "results.md"), encoding="utf-8") as f:
        return results, f.read()


@pytest.mark.parametrize("where", SWEEPS)
def test_student_sweep_md_is_regenerated_from_results_json(where):
    results, md = _results(os.path.join(ROOT, "experiments", "kimi_k3", where))
    assert student_sweep.report_md(results) == md
    assert results["commit"] != "unknown" and "preset" in results["variants"]
    # every row pairs with the run's own problems: as many per cell as the evaluation drew
    n = results["eval"]["n"]
    for s in results["per_seed"]:
        assert all(len(v) == n for m in s["models"].values() for v in m.values())


@pytest.mark.parametrize("where", ["", "before_unk_fix"])
def test_cross_tokenizer_demo_md_is_regenerated_from_results_json(where):
    from studies import cross_tokenizer_demo as demo
    res, md = _results(os.path.join(ROOT, "experiments", "cross_tokenizer", where))
    assert demo.report_md(res) == md
    assert res["commit"] != "unknown" and res["wall_s"] > 0
    # the claims are the study's function of the passes alone
    n = len(res["passes"]["start"])
    assert n == len(res["passes"]["student"]) == len(res["passes"]["teacher"]) == 128
    g = res["gain"]
    assert g["diff"] == pytest.approx(sum(res["passes"]["student"]) / n
                                      - sum(res["passes"]["start"]) / n)
    assert res["claim"]["pass"] == (g["diff"] >= demo.GAIN and g["diff"] > demo.K_SE * g["se"])
