"""Token write-ahead log: framing, torn tails, job identity, and SIGKILL + resume."""
import os
import subprocess
import sys

import numpy as np
import pytest
from rollout_fixtures import random_model
from wal_child import KW, PROMPTS

from opd_jax.rollout import generate
from opd_jax.rollout.wal import TokenLog, frame, replay
from tests.procs import sigkill_when

HERE = os.path.dirname(os.path.abspath(__file__))


def test_records_commit_torn_tail_and_corruption(tmp_path):
    path = tmp_path / "log"
    log = TokenLog(path, {"job": 1})
    log.append_token(0, 5, 42, -1.5)
    log.append_token(1, 3, 7, -0.25, forced=True)
    log.commit()
    log.append_token(0, 6, 43, -2.0)
    log.append_finish(0, 1)
    log.commit()
    log.append_token(1, 4, 8, -1.0)  # buffered, never committed
    log.close()
    header, toks, fin, end = replay(path)
    assert header == {"job": 1} and fin == {0: 1} and end == os.path.getsize(path)
    assert toks == {0: [(5, 42, -1.5, False), (6, 43, -2.0, False)], 1: [(3, 7, -0.25, True)]}
    data = path.read_bytes()
    for cut in (1, 9, 20):  # torn last chunk: only the first chunk survives
        path.write_bytes(data[:-cut])
        _, toks, fin, _ = replay(path)
        assert fin == {} and toks == {0: [(5, 42, -1.5, False)], 1: [(3, 7, -0.25, True)]}
    bad = bytearray(data)
    bad[-3] ^= 0xFF  # flip a byte of the last COMMIT: its CRC fails
    path.write_bytes(bytes(bad))
    assert replay(path)[2] == {}
    # appending after a torn tail truncates it first
    path.write_bytes(data + frame(b"\x02garbage")[:-2])
    log = TokenLog(path, {"job": 1}, truncate_at=replay(path)[3])
    log.append_finish(1, 2)
    log.commit()
    log.close()
    assert replay(path)[2] == {0: 1, 1: 2}


def test_resume_rejects_another_jobs_log(tmp_path):
    model = random_model(seed=0)
    path = str(tmp_path / "log")
    generate(model, PROMPTS, wal_path=path, **KW)
    with pytest.raises(ValueError, match="belongs to another job"):
        generate(model, PROMPTS, wal_path=path, **{**KW, "seed": 12})


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    path = str(tmp_path / "job.wal")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), HERE]),
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "wal_child.py"), path],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sigkill_when(child, lambda: os.path.exists(path)
                 and sum(map(len, replay(path)[1].values())) >= 12, timeout=240, poll=0.05)
    _, logged, finished, _ = replay(path)
    assert 12 <= sum(map(len, logged.values())) and len(finished) < len(PROMPTS)

    model = random_model(seed=0)
    resumed = generate(model, PROMPTS, wal_path=path, **KW)
    straight = generate(model, PROMPTS, **{**KW, "steps_per_call": None})
    assert resumed.tokens == straight.tokens
    assert resumed.finish_reasons == straight.finish_reasons
    for a, b in zip(resumed.logprobs, straight.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # the log now holds every row's finished sequence, once
    _, logged, finished, _ = replay(path)
    assert sorted(finished) == list(range(len(PROMPTS)))
    assert [[t for _, t, _, _ in sorted(logged[b])] for b in range(len(PROMPTS))] \
        == resumed.tokens
