"""A training run SIGKILLed in the middle of a rollout resumes that rollout from its token
log (no logged token is sampled again) and ends with the uninterrupted run's checkpoint."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from opd_jax.episodes import wal
from opd_jax.trainers.metrics import read_metrics
from tests.procs import sigkill_when
from tests.trainers.test_policy_smoke import SMALL
from tests.trainers.test_sft import _final_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
ITERS = 4


def _args(workdir):
    return ["grpo", "--config", os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"), "--workdir",
            str(workdir), "--no-progress", *SMALL, f"--config.train.steps={ITERS}",
            "--config.train.ckpt_every=2", "--config.rollout.prompts_per_step=4",
            "--config.rollout.group_size=2", "--config.rollout.sampling.max_new_tokens=24",
            "--config.rollout.wal_every=2", "--config.eval.every=0"]


def _logged_tokens(path):
    if not os.path.exists(path):
        return 0
    return sum(r[0] == wal.TOKEN for r in wal.read_log(path)[1])


@pytest.mark.slow
def test_sigkill_mid_rollout_resumes_from_the_token_log(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), JAX_PLATFORMS="cpu",
               XLA_FLAGS="")
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run([sys.executable, "-m", "opd_jax", *_args(full)], env=env, check=True,
                   capture_output=True)
    # Kill inside the 4th rollout: after checkpoint 2, with iteration 3 done but not
    # checkpointed (its log complete) and iteration 4's log holding some tokens.
    log4 = killed / "rollout_wal" / "iter_000003.wal"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "rollout_kill_child.py"),
                             *_args(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    sigkill_when(proc, lambda: _logged_tokens(log4) >= 8, timeout=400)
    ckpts = sorted(int(s) for s in os.listdir(killed / "checkpoints") if s.isdigit())
    assert ckpts == [2], ckpts     # one optimizer step per iteration
    assert (killed / "rollout_wal" / "iter_000002.wal").exists()
    partial = _logged_tokens(log4)

    subprocess.run([sys.executable, "-m", "opd_jax", *_args(killed)], env=env, check=True,
                   capture_output=True)
    a, b = _final_params(full, ITERS), _final_params(killed, ITERS)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    by_step = lambda w: {m["step"]: m for m in read_metrics(str(w))}
    f, k = by_step(full), by_step(killed)
    assert sorted(k) == sorted(f) == list(range(1, ITERS + 1))
    assert all(k[s]["reward/mean"] == f[s]["reward/mean"] for s in f)
    # iteration 3 came whole from its log, iteration 4 in part; the full run resumed none
    assert k[3]["rollout/resumed_tokens"] >= f[3]["response_len"] * 8 > 0
    assert k[4]["rollout/resumed_tokens"] >= partial > 0
    assert all(f[s]["rollout/resumed_tokens"] == 0 for s in f)
