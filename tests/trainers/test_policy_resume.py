"""A SIGKILLed GRPO or OPD run resumes from its last checkpoint with the same result.

Rollout seeds derive from (seed, iteration), the task iterator is checkpointed with the
train state, and teachers are reloaded on demand, so the resumed run must end with
bitwise-equal parameters and log the same rewards as an uninterrupted one.
"""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from opd_jax.trainers.metrics import read_metrics
from tests.trainers.test_policy_smoke import SMALL, _teacher
from tests.trainers.test_sft import _final_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 4


def _cli(command, preset, workdir, *extra):
    return [sys.executable, "-m", "opd_jax", command, "--config",
            os.path.join(ROOT, f"opd_jax/configs/{preset}"), "--workdir", str(workdir),
            "--no-progress",
            *SMALL, f"--config.train.steps={ITERS}", "--config.rollout.prompts_per_step=4",
            "--config.eval.every=0", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("command,preset", [("grpo", "grpo.py:tiny"),
                                            ("opd", "opd.py:deepseek_full_vocab")])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, command, preset):
    # GRPO with its KL penalty on: the resumed run's reference must be the initial policy
    extra = (["--config.rollout.group_size=2", "--config.objective.options.kl_beta=0.1"]
             if command == "grpo" else [])
    if command == "opd":   # two teachers, room for one: loads/evictions are part of the state
        t1, t2 = _teacher(tmp_path / "t1"), _teacher(tmp_path / "t2")
        extra = ["--config.tasks.efforts=('low', 'high')", "--config.teachers.routing=cell",
                 "--config.teachers.max_loaded=1",
                 f"--config.teachers.paths={{'general/low': '{t1}', 'general/high': '{t2}'}}"]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cli(command, preset, full, *extra), env=env, check=True,
                   capture_output=True)

    proc = subprocess.Popen(_cli(command, preset, killed, *extra), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    ckpts = killed / "checkpoints"
    while not (ckpts.is_dir() and any(s.isdigit() for s in os.listdir(ckpts))):
        assert proc.poll() is None and time.time() < deadline, "run ended before a checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(int(s) for s in os.listdir(ckpts) if s.isdigit())
    assert done[-1] < ITERS, "the kill came too late to test anything"

    subprocess.run(_cli(command, preset, killed, *extra), env=env, check=True,
                   capture_output=True)
    a, b = _final_params(full, ITERS), _final_params(killed, ITERS)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The same samples were drawn after the resume: rewards per iteration match.
    reward = lambda w: {m["step"]: m["reward/mean"] for m in read_metrics(str(w))}
    assert reward(killed) == reward(full) and sorted(reward(full)) == list(range(1, ITERS + 1))
    # The compute counts continue across the resume (saved in the checkpoints' meta).
    counts = lambda w: json.load(open(w / "compute.json"))
    assert counts(killed) == counts(full) and counts(full)["tokens"]["rollouts"] == 4 * ITERS * (
        2 if command == "grpo" else 1)
    if command == "opd":
        stats = json.load(open(full / "teacher_cache.json"))["stats"]
        assert stats["evictions"] >= 1
