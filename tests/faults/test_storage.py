"""Issue 30, clean failures of storage: a full disk, a write that fails mid-way and a
corrupt step's fall-back end in one line (or one warning), not dozens of Orbax and
tensorstore tracebacks ("Event loop is closed")."""
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from opd_jax.cli import main
from tests.faults.conftest import GOOD, ROOT, SFT, TINY
from tests.faults.test_integrity import _data_files, _flip_middle

ARGS = ["sft", "--config", SFT, *TINY, *GOOD, "--no-progress"]
# The tiny preset's own 0.4M-parameter model: a 4.8 MB train state, past a 3 MiB disk.
FULL = ["sft", "--config", SFT, *GOOD, "--config.data.batch_size=8", "--no-progress"]


def test_a_disk_too_full_for_the_checkpoint_fails_in_one_line_before_writing(
        tmp_path, capfd, monkeypatch):
    from opd_jax.checkpoint import storage
    real = shutil.disk_usage
    monkeypatch.setattr(storage.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=200_000))
    workdir = tmp_path / "run"
    assert main([*ARGS, "--workdir", str(workdir)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: [Errno 28] writing checkpoint 4 under {workdir}/checkpoints:"
                          f" no space left: it needs ") and "195.3 KiB free" in err
    assert not (workdir / "checkpoints" / "4").exists()


def test_a_write_that_fails_mid_way_is_one_line_and_leaves_no_partial_step(
        tmp_path, capfd, monkeypatch):
    """Injected failure: the second checkpoint's write raises tensorstore's ENOSPC error
    from inside Orbax's save, after it made its temporary folder."""
    import orbax.checkpoint as ocp
    real_save = ocp.CheckpointManager.save
    calls = []

    def failing_save(self, step, *a, **k):
        calls.append(step)
        if step == 8:
            os.makedirs(os.path.join(self.directory, "8.orbax-checkpoint-tmp-1"))
            raise ValueError("RESOURCE_EXHAUSTED: Error writing \"params.embed/0\": Failed to "
                             "write 4096 bytes: No space left on device [os_error_code='28']")
        return real_save(self, step, *a, **k)
    monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    workdir = tmp_path / "run"
    assert main([*ARGS, "--workdir", str(workdir)]) == 2
    err = capfd.readouterr().err
    assert err == (f"error: [Errno 28] writing checkpoint 8 under {workdir}/checkpoints: no "
                   f"space left on device; the earlier checkpoints [4] are kept. Free some "
                   f"space (or use another --workdir) and re-run to resume: "
                   f"'{workdir}/checkpoints'\n")
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4"] and calls == [4, 8]


def test_a_corrupt_steps_fall_back_prints_one_warning_and_no_traceback(run_copy, capfd):
    """It printed 18-82 lines of asyncio "Event loop is closed" tracebacks."""
    for f in _data_files(run_copy / "checkpoints" / "8"):
        _flip_middle(f)
    with pytest.warns(RuntimeWarning, match="checkpoint step 8 .* is corrupt or unreadable"):
        assert main([*ARGS, "--config.train.steps=12", "--workdir", str(run_copy)]) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    assert (run_copy / "checkpoints" / "8.corrupt").is_dir()


@pytest.mark.slow
def test_a_real_full_disk_mid_write_is_one_line(tmp_path):
    """A 3 MiB tmpfs (root only; skipped where it cannot be mounted): the space check
    switched off so that Orbax really writes until the disk is full; before, this printed
    757 lines (tensorstore's "Event loop is closed" tracebacks, absl and asyncio logs)."""
    mnt = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        code = ("import sys; import opd_jax.checkpoint.manager as m; "
                "m.check_space = lambda *a: None; from opd_jax.cli import main; "
                f"sys.exit(main({[*FULL, '--workdir', str(mnt / 'run')]!r}))")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=ROOT, timeout=600, env=dict(os.environ, XLA_FLAGS=""))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("\n") == 1 and "no space left on device" in p.stderr, p.stderr[-3000:]
