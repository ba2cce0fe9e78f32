"""studies/dose_table.py: pooled pass rates with standard errors over problems, the dose a
run recorded, and a table of low / high / max per (base, family, difficulty)."""
import json
import math

from studies.dose_table import markdown, run_dose, table_rows


def _rows():
    out = []
    for seed, passes in ((0, (0.25, 0.5, 0.75)), (1, (0.5, 0.5, 1.0))):
        for e, p in zip(("low", "high", "max"), passes):
            out.append({"base": "dose60", "family": "chain", "difficulty": 3, "effort": e,
                        "n": 8, "pass_rate": p, "reward": p * 0.9, "seed": seed})
    return out


def test_table_pools_seeds_and_counts_problems():
    table = table_rows(_rows())
    mx = next(r for r in table if r["effort"] == "max")
    assert mx["n"] == 16 and math.isclose(mx["pass_rate"], 0.875)
    assert math.isclose(mx["pass_se"], math.sqrt(0.875 * 0.125 / 16))
    assert math.isclose(mx["reward"], 0.875 * 0.9)


def test_markdown_and_recorded_dose(tmp_path):
    dose = {"chain": {"3": 60, "4": 0}}
    (tmp_path / "config.json").write_text(json.dumps({"data": {"corpus": {"dose": dose}}}))
    assert run_dose(str(tmp_path)) == dose and run_dose(str(tmp_path / "none")) == {}
    text = markdown({"command": "c", "commit": "abc", "wall_s": 60.0, "n": 8, "seeds": [0, 1],
                     "doses": {"dose60": dose}, "table": table_rows(_rows())})
    assert "| dose60 | chain | 3 | 0.375 ± 0.121 | 0.500 ± 0.125 | 0.875 ± 0.083 | 0.788 |" \
        in text
    assert '"3": 60' in text
