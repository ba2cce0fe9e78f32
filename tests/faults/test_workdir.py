"""Cases 3 and 4 and the workdir checks: a resumed run keeps its config (only documented
resumable fields may change; --resume_with_changes records any other change); one run at a
time holds a workdir (pid and host named; a dead holder's lock is taken over); a workdir
that is a file or is not writable fails up front, naming it."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from opd_jax.checkpoint import WorkdirError
from opd_jax.cli import main
from opd_jax.trainers.run_sft import train_sft
from opd_jax.trainers.workdir import RESUMABLE, config_diff, open_workdir
from tests.faults.conftest import GOOD, ROOT, SFT, TINY, checkpoint_snapshot, sft_cfg


@pytest.mark.parametrize("override, shown", [
    ("--config.optim.lr=0.1", "optim.lr: 0.003 -> 0.1"),
    ("--config.data.seq_len=24", "data.seq_len: 16 -> 24"),
    ("--config.data.batch_size=16", "data.batch_size: 8 -> 16"),
    ("--config.seed=3", "seed: 0 -> 3"),
])
def test_resume_under_another_config_is_refused_with_the_diff(run_copy, override, shown):
    before = checkpoint_snapshot(run_copy)
    with pytest.raises(WorkdirError, match=f"holds a run \\(checkpoint step 8\\) under another "
                                           f"config: {shown}.*--resume_with_changes"):
        train_sft(sft_cfg("--config.train.steps=12", override), str(run_copy), progress=False)
    assert checkpoint_snapshot(run_copy) == before
    assert not (run_copy / "config_changes.jsonl").exists()


def test_resumable_fields_and_recorded_changes(run_copy):
    saved = json.load(open(run_copy / "config.json"))
    # Extending the run, logging/saving more often, another mesh or remat: no diff.
    assert config_diff(saved, sft_cfg("--config.train.steps=100", "--config.train.log_every=5",
                                      "--config.train.ckpt_every=2", "--config.model.remat=layer",
                                      "--config.mesh.shape=(1,1,1)")) == {}
    assert "train.steps" in RESUMABLE
    # With the flag the change is accepted, recorded and becomes the run's config.
    out = train_sft(sft_cfg("--config.train.steps=10", "--config.optim.lr=1e-3"),
                    str(run_copy), progress=False, resume_with_changes=True)
    assert out["step"] == 10
    (change,) = [json.loads(x) for x in open(run_copy / "config_changes.jsonl")]
    assert change["from_step"] == 8
    assert change["changes"] == {"optim.lr": {"from": 0.003, "to": 0.001},
                                 "train.steps": {"from": 8, "to": 10}}
    assert json.load(open(run_copy / "config.json"))["optim"]["lr"] == 1e-3
    # ... so resuming again under the new config needs no flag and records nothing; a
    # resumable change (more steps) is recorded without the flag.
    assert train_sft(sft_cfg("--config.train.steps=10", "--config.optim.lr=1e-3"),
                     str(run_copy), progress=False)["step"] == 10
    assert len(open(run_copy / "config_changes.jsonl").readlines()) == 1
    assert train_sft(sft_cfg("--config.train.steps=11", "--config.optim.lr=1e-3"),
                     str(run_copy), progress=False)["step"] == 11
    last = json.loads(open(run_copy / "config_changes.jsonl").readlines()[-1])
    assert last["from_step"] == 10 and last["changes"] == {"train.steps": {"from": 10,
                                                                          "to": 11}}
    assert json.load(open(run_copy / "config.json"))["train"]["steps"] == 11


def _hold(workdir, holder):
    fd = os.open(os.path.join(workdir, "run.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(holder).encode())
    return fd


def test_a_held_workdir_is_refused_naming_the_holder(run_copy):
    before = checkpoint_snapshot(run_copy)
    fd = _hold(run_copy, {"pid": 4242, "host": "trainer-7", "started": "2026-01-01T00:00:00"})
    try:
        with pytest.raises(WorkdirError, match="is in use by another run \\(pid 4242 on host "
                                               "trainer-7, since 2026-01-01T00:00:00"):
            train_sft(sft_cfg("--config.train.steps=12"), str(run_copy), progress=False)
    finally:
        os.close(fd)
    assert checkpoint_snapshot(run_copy) == before


def test_a_dead_holders_lock_is_taken_over(run_copy, caplog):
    with open(run_copy / "run.lock", "w") as f:      # a SIGKILLed run leaves this behind
        json.dump({"pid": 999_999, "host": "gone"}, f)
    ckpt = open_workdir(str(run_copy), sft_cfg(), _model_meta())
    try:
        assert json.load(open(run_copy / "run.lock"))["pid"] == os.getpid()
        assert "stale lock" in caplog.text and "999999" in caplog.text
    finally:
        ckpt.close()
    assert json.load(open(run_copy / "run.lock"))["released"] is True


def _model_meta():
    from opd_jax.trainers import builders
    return builders.planned_model_config(sft_cfg().model).to_dict()


def test_bad_workdirs_fail_up_front(tmp_path, capsys):
    file = tmp_path / "a_file"
    file.write_text("keep me")
    args = ["sft", "--config", SFT, *TINY, *GOOD, "--no-progress"]
    assert main([*args, "--workdir", str(file)]) == 2
    assert f"workdir '{file}' is a file, not a folder" in capsys.readouterr().err
    assert file.read_text() == "keep me"
    if os.geteuid() == 0:       # root ignores permissions; /sys refuses new folders
        ro = "/sys/opd_jax_faults_workdir"
    else:
        ro = str(tmp_path / "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o500)
    assert main([*args, "--workdir", ro]) == 2
    err = capsys.readouterr().err
    assert f"workdir '{ro}' is not writable" in err and err.count("\n") == 1


def _cli(workdir, steps, *extra):
    return [sys.executable, "-m", "opd_jax", "sft", "--config", SFT, "--workdir", str(workdir),
            "--no-progress", *TINY, f"--config.train.steps={steps}",
            "--config.train.ckpt_every=4", *extra]


ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")


@pytest.mark.slow
def test_two_runs_into_one_workdir(tmp_path):
    """The second run exits at once naming the first's pid; the first is undisturbed."""
    workdir = tmp_path / "run"
    long = ("--config.train.ckpt_every=100",)
    first = subprocess.Popen(_cli(workdir, 300, *long), env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while not (workdir / "metrics.jsonl").exists():      # the first run is training
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.05)
    second = subprocess.run(_cli(workdir, 300, *long), env=ENV, capture_output=True, text=True)
    assert second.returncode == 2
    assert f"is in use by another run (pid {first.pid} on host" in second.stderr
    assert first.wait() == 0
    from opd_jax.trainers.metrics import read_metrics
    assert [m["step"] for m in read_metrics(str(workdir))] == list(range(1, 301))


@pytest.mark.slow
def test_sigkilled_run_leaves_a_stale_lock_and_resumes_bitwise(tmp_path):
    import jax
    import numpy as np
    from tests.trainers.test_sft import _final_params
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cli(full, 16), env=ENV, check=True, capture_output=True)
    proc = subprocess.Popen(_cli(killed, 16), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "4").is_dir():
        assert proc.poll() is None and time.time() < deadline, "run ended before checkpoint 4"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.load(open(killed / "run.lock"))["pid"] == proc.pid    # left behind
    resumed = subprocess.run(_cli(killed, 16), env=ENV, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "taking over the stale lock" in resumed.stderr
    for x, y in zip(jax.tree.leaves(_final_params(full, 16)),
                    jax.tree.leaves(_final_params(killed, 16))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rerunning_a_finished_run_says_so(good_run, run_copy, capsys):
    """Issue 30: a finished run re-run printed "loss nan" / "iteration None"."""
    from opd_jax.cli import main
    from tests.faults.conftest import GOOD, SFT, TINY
    argv = ["sft", "--config", SFT, *TINY, *GOOD, "--workdir", str(run_copy), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "had already finished all 8 steps (last logged loss" in out and "nan" not in out


def test_resume_with_a_changed_optimizer_structure_says_so_and_writes_nothing(run_copy):
    """Issue 30: --resume_with_changes with a new optimizer said "no intact checkpoint"
    about intact ones and rewrote config.json (and a failed one left its values pinned)."""
    before = checkpoint_snapshot(run_copy)
    config = (run_copy / "config.json").read_text()
    with pytest.raises(WorkdirError, match="could not be restored under the changed optimizer "
                                           "settings \\(optim.name\\).*another structure.*"
                                           "config.json unchanged"):
        train_sft(sft_cfg("--config.train.steps=10", "--config.optim.name=sgd"),
                  str(run_copy), progress=False, resume_with_changes=True)
    assert checkpoint_snapshot(run_copy) == before
    assert (run_copy / "config.json").read_text() == config
    assert not (run_copy / "config_changes.jsonl").exists()
    # nothing pinned: resuming under the saved config still works without the flag
    assert train_sft(sft_cfg("--config.train.steps=10"), str(run_copy),
                     progress=False)["step"] == 10
