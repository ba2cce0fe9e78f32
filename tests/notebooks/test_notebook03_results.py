"""notebooks/results/03_tiny_mopd.{json,md}, written by notebook 03: the committed table and
claims are studies.notebook03's functions of the committed per-problem passes alone, and the
claims are the ones the notebook asserts (so a hand-edited file fails here)."""
import json
import os

import pytest

from studies import notebook03

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "notebooks", "results", "03_tiny_mopd")
NOTEBOOK = os.path.join(ROOT, "notebooks", "03_tiny_mopd.ipynb")


def _raw() -> dict:
    with open(RESULTS + ".json", encoding="utf-8") as f:
        return json.load(f)


def test_markdown_is_regenerated_from_the_json(tmp_path):
    out = tmp_path / "03_tiny_mopd.md"
    notebook03.write_markdown(RESULTS + ".json", str(out))
    with open(RESULTS + ".md", encoding="utf-8") as f:
        assert out.read_text() == f.read()


def test_the_committed_claims_are_the_notebooks_and_hold():
    res = notebook03.load(RESULTS + ".json")   # numbers = derive(passes), claims = claims()
    checked = notebook03.claims(res)
    assert [tuple(c) for c in res["claims"]] == checked
    assert [name for name, _, _ in checked] == list(notebook03.CLAIMS)
    assert all(ok for _, ok, _ in checked), checked
    # ... and the notebook asserts exactly these, computed from the file it wrote
    with open(NOTEBOOK, encoding="utf-8") as f:     # an .ipynb is JSON
        source = "\n".join("".join(c["source"]) for c in json.load(f)["cells"]
                           if c["cell_type"] == "code")
    assert "notebook03.load(RESULTS)" in source and "notebook03.claims(results)" in source
    assert "assert all(ok for _, ok, _ in checked)" in source
    # a real run: provenance, the protocol's sizes, one pass per problem
    assert res["commit"] not in ("", "unknown") and res["wall_s"] > 0 and res["seed"] == 0
    assert res["eval"]["n"] == 256 and res["start"] == "builtin:base"
    st = res["settings"]
    assert len(res["cells"]) == 2
    for c in res["cells"].values():
        assert c["n"] == 256 and all(len(p) == 256 for p in c["passes"].values())
        assert [s for s, _ in c["curve"]] == list(range(
            st["student_eval_every"], st["student_iterations"] + 1, st["student_eval_every"]))


def test_a_hand_edited_number_or_claim_is_refused(tmp_path):
    res = _raw()
    cell = next(iter(res["cells"]))
    res["cells"][cell]["pass_rate"]["student"] += 0.01
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(res))
    with pytest.raises(ValueError, match="differ from what its passes give"):
        notebook03.write_markdown(str(path), str(tmp_path / "edited.md"))
    res = _raw()
    res["claims"][0][1] = not res["claims"][0][1]
    path.write_text(json.dumps(res))
    with pytest.raises(ValueError, match="claims differ"):
        notebook03.load(str(path))


def test_claims_follow_the_passes():
    n = 40
    start = "0" * n
    gained = "1" * 30 + "0" * 10
    passes = {"start": start, "specialist_general": gained, "specialist_coding": start,
              "merge": "1" * 10 + "0" * 30, "student": gained}
    cell = notebook03.derive(passes, "specialist_general")
    assert cell["n"] == n and cell["pass_rate"]["student"] == 0.75
    assert cell["gain_kept"] == {"student": 1.0, "merge": pytest.approx(1 / 3)}
    assert cell["student_vs_merge"]["diff"] == 0.5
    res = {"cells": {"general/max": {"teacher": "specialist_general", **cell}}}
    assert [ok for _, ok, _ in notebook03.claims(res)] == [True, True, True]
    res["cells"]["coding/max"] = {"teacher": "specialist_coding",
                                  **notebook03.derive(passes, "specialist_coding")}
    # coding's specialist did not gain: the first claim fails, the others still hold
    assert [ok for _, ok, _ in notebook03.claims(res)] == [False, True, True]


def test_bad_passes_are_refused():
    with pytest.raises(ValueError, match="0 or 1"):
        notebook03.pass_string([0, 1, 2])
    ok = {m: "01" for m in notebook03.MODELS}
    with pytest.raises(ValueError, match="string of 0 and 1"):
        notebook03.derive(ok | {"merge": "0x"}, "specialist_general")
    with pytest.raises(ValueError, match="one pass per problem"):
        notebook03.derive(ok | {"merge": "011"}, "specialist_general")
    with pytest.raises(ValueError, match="missing"):
        notebook03.derive({"start": "01"}, "specialist_general")
