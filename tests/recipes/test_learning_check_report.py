"""learning_check's bookkeeping: rows that distill another row's model, and the table."""
import numpy as np
import pytest

from studies import learning_check as lc


def test_a_row_distilling_another_row_needs_that_row_first(tmp_path):
    models = {"root": str(tmp_path), "teachers": {"general": "t_g", "coding": "t_c"}}
    with pytest.raises(FileNotFoundError, match="run `--objectives grpo` first"):
        lc.teachers_of(models, "kimi_from_grpo")
    (tmp_path / "grpo").mkdir()
    t = lc.teachers_of(models, "kimi_from_grpo")
    assert t == {"general": str(tmp_path / "grpo"), "coding": "t_c"}
    assert lc.teachers_of(models, "kimi_g1") == models["teachers"]


def _cell(after, teacher, curve):
    return {"before": 0.1, "after": after, "final_level": after, "teacher": teacher,
            "fraction_of_teacher": None if teacher is None else after / teacher,
            "first_iteration_at_90pct": None, "first_iteration_at_95pct": None,
            "paired_diff": after - 0.1, "paired_se": 0.01,
            "after_rewards": list(np.full(4, after)), "curve": curve}


def test_report_lists_the_speed_rows_curves_and_their_own_teacher():
    rows = {}
    for row, teacher, curve in [("grpo", 0.5, [[10, 0.2], [20, 0.3]]),
                                ("kimi_from_grpo", 0.3, [[2, 0.15], [4, 0.25]])]:
        rows[row] = {"general/high": _cell(curve[-1][1], teacher, curve),
                     "coding/high": _cell(0.7, 0.7, []), "settings": lc.SETTINGS[row],
                     "wall_s": 60.0, "commit": "abc", "command": "cmd"}
    rows["grpo"]["coding/high"]["fraction_of_teacher"] = float("nan")   # GRPO: no coding curve
    md = lc.report_md({"rows": rows, "teacher_reward": {"general/high": 0.5}, "commands": []})
    line = next(x for x in md.splitlines() if x.startswith("| kimi_from_grpo |"))
    assert "| 0.300 | 83% |" in line                 # its teacher is the grpo row's model
    assert "- kimi_from_grpo: 2: 0.150, 4: 0.250" in md
    assert "- grpo: 10: 0.200, 20: 0.300" in md
    assert "nan" not in md
