"""A resumed run logs each step once: records of the lost run past the resume point are
dropped from metrics.jsonl (atomic rewrite, kept in metrics.dropped.jsonl) and its
TensorBoard events are purged (purge_step) instead of being shown twice."""
import glob
import json
import os
import shutil
import struct

from tensorboardX.proto import event_pb2

from opd_jax.trainers.metrics import MetricsWriter, read_metrics
from opd_jax.trainers.run_sft import train_sft
from tests.faults.conftest import sft_cfg


def _log(workdir, steps, value, **kw):
    w = MetricsWriter(str(workdir), **kw)
    for s in steps:
        w.write(s, {"loss": value + s})
    w.close()


def _events(path):
    """Every Event of a TFRecord event file."""
    out, data = [], open(path, "rb").read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
        i += 12 + n + 4
    return out


def _tensorboard_view(workdir):
    """{(tag, step): [values]} as TensorBoard shows it: files in name order, a
    SessionLog.START at step p hides the earlier events of steps >= p."""
    seen = []
    for path in sorted(glob.glob(os.path.join(str(workdir), "tb", "events.out.tfevents.*"))):
        for e in _events(path):
            if e.HasField("session_log") and e.session_log.status == e.session_log.START:
                seen = [x for x in seen if x[1] < e.step]
            for v in e.summary.value:
                seen.append((v.tag, e.step, v.simple_value))
    view = {}
    for tag, step, value in seen:
        view.setdefault((tag, step), []).append(value)
    return view


def test_relogged_steps_replace_the_lost_runs(tmp_path):
    _log(tmp_path, range(1, 9), 0.0)                  # killed after logging 8 ...
    _log(tmp_path, range(5, 11), 100.0)              # ... resumed from checkpoint 4
    recs = read_metrics(str(tmp_path))
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["loss"] for r in recs] == [float(s) for s in range(1, 5)] + \
        [100.0 + s for s in range(5, 11)]
    dropped = [json.loads(x) for x in open(tmp_path / "metrics.dropped.jsonl")]
    assert [r["step"] for r in dropped] == [5, 6, 7, 8]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    view = _tensorboard_view(tmp_path)
    assert len(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))) == 2
    assert {k: v for k, v in view.items()} == {
        ("loss", s): [float(s) if s < 5 else 100.0 + s] for s in range(1, 11)}


def test_resume_step_given_at_open_and_a_torn_last_line(tmp_path):
    _log(tmp_path, range(1, 9), 0.0)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')                      # SIGKILL in the middle of a write
    # the caller knows the checkpoint step: stale records go at open, before any write
    w = MetricsWriter(str(tmp_path), resume_step=6)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(1, 7))
    w.write(8, {"loss": 50.0})                       # log_every changed: 7 is never logged
    w.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4, 5, 6, 8]
    view = _tensorboard_view(tmp_path)
    assert sorted(s for _, s in view) == [1, 2, 3, 4, 5, 6, 8]
    assert all(len(v) == 1 for v in view.values())


def test_a_fresh_run_and_a_plain_extension_rewrite_nothing(tmp_path):
    _log(tmp_path, range(1, 5), 0.0)
    before = os.stat(tmp_path / "metrics.jsonl").st_ino
    _log(tmp_path, range(5, 7), 0.0)                 # resumed at the last logged step
    assert os.stat(tmp_path / "metrics.jsonl").st_ino == before
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(1, 7))
    assert not (tmp_path / "metrics.dropped.jsonl").exists()


def test_sft_killed_before_its_checkpoint_resumes_without_duplicate_steps(run_copy):
    """The good run logged 1..8 and saved 4 and 8; without checkpoint 8 (the kill came
    after step 8 was logged, before it was saved) the resume from 4 logs 5..8 again."""
    full = read_metrics(str(run_copy))
    shutil.rmtree(run_copy / "checkpoints" / "8")
    out = train_sft(sft_cfg(), str(run_copy), progress=False)
    assert out["step"] == 8
    recs = read_metrics(str(run_copy))
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["loss"] for r in recs] == [r["loss"] for r in full]      # the resume is exact
    view = _tensorboard_view(run_copy)
    assert sorted({s for _, s in view}) == list(range(1, 9))
    assert all(len(v) == 1 for v in view.values())
