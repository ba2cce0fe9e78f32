"""The commit recorded with every result says when the code differed from it."""
import subprocess

from opd_jax.recipes import pipeline, report


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo,
                   check=True, capture_output=True)


def test_commit_is_marked_dirty_only_for_code_and_config_changes(tmp_path, monkeypatch):
    (tmp_path / "opd_jax").mkdir()
    (tmp_path / "opd_jax" / "x.py").write_text("a = 1\n")
    (tmp_path / "README.md").write_text("doc\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "c")
    monkeypatch.setattr(pipeline, "REPO", str(tmp_path))
    head = report.code_commit()
    assert len(head) >= 7 and not head.endswith("-dirty")
    (tmp_path / "README.md").write_text("doc, edited\n")          # docs do not move results
    assert report.code_commit() == head
    (tmp_path / "opd_jax" / "x.py").write_text("a = 2\n")
    assert report.code_commit() == head + "-dirty"
    _git(tmp_path, "commit", "-qam", "d")
    head = report.code_commit()
    assert not head.endswith("-dirty")
    (tmp_path / "studies").mkdir()                                # a new, untracked study
    (tmp_path / "studies" / "new.py").write_text("b = 1\n")
    assert report.code_commit() == head + "-dirty"
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "e")
    head = report.code_commit()
    (tmp_path / "notebooks").mkdir()                              # a notebook that writes results
    (tmp_path / "notebooks" / "n.ipynb").write_text("{}\n")
    assert report.code_commit() == head + "-dirty"
    monkeypatch.setattr(pipeline, "REPO", str(tmp_path / "not_a_repo"))
    assert report.code_commit() == "unknown"
