"""The README's speed table is generated from the committed benchmark results."""
import os
import shutil

import pytest

from tests.benchmarks import load

speed_table = load("speed_table")


def test_the_readme_table_is_the_one_the_results_give():
    assert speed_table.main(["--check"]) == 0


def test_a_changed_result_changes_the_table_and_check_catches_it(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(speed_table.RESULTS, results)
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(speed_table.ROOT, "README.md"), readme)
    monkeypatch.setattr(speed_table, "RESULTS", str(results))
    real = results / "rollout_real_cpu.txt"
    text = real.read_text()
    ratio = next(line for line in text.splitlines() if "ratio ours / transformers" in line)
    real.write_text(text.replace(ratio, ratio.replace("ratio ours / transformers",
                                                      "ratio ours / transformers 9.99x #"), 1))
    assert speed_table.main(["--check", "--readme", str(readme)]) == 1
    assert speed_table.main(["--readme", str(readme)]) == 0
    assert "| 9.99x |" in readme.read_text()
    assert speed_table.main(["--check", "--readme", str(readme)]) == 0


def test_a_results_file_missing_a_number_is_named(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(speed_table.RESULTS, results)
    monkeypatch.setattr(speed_table, "RESULTS", str(results))
    path = results / "rollout_cpu.txt"
    path.write_text("\n".join(l for l in path.read_text().splitlines()
                              if not l.startswith("compile")))
    with pytest.raises(ValueError, match="rollout_cpu.txt: no compile line"):
        speed_table.render()
