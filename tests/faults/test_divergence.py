"""Case 1 (and the skip knob): a non-finite loss or gradient norm stops training, naming the
step, before any checkpoint of that state is written; the good checkpoints stay as they were."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.trainers.metrics import DivergenceError, DivergenceGuard
from opd_jax.trainers.run_sft import train_sft
from opd_jax.trainers.state import TrainState, guard_nonfinite
from tests.faults.conftest import checkpoint_snapshot, sft_cfg


def test_huge_lr_stops_before_a_bad_checkpoint(run_copy):
    before = checkpoint_snapshot(run_copy)
    cfg = sft_cfg("--config.train.steps=24", "--config.optim.lr=1e10")
    with pytest.raises(DivergenceError) as e:
        train_sft(cfg, str(run_copy), progress=False, resume_with_changes=True)
    msg = str(e.value)
    step = int(msg.split("training diverged at step ")[1].split(":")[0])
    assert 8 < step <= 24 and "not finite" in msg and "optim.lr (now 1e+10)" in msg
    assert "the last checkpoint is step" in msg
    # Nothing of the diverged state reached disk: the only checkpoints are finite ones.
    after = checkpoint_snapshot(run_copy)
    assert {k: v for k, v in after.items() if k.startswith("checkpoints/")
            and k.split("/")[1] in ("4", "8")} == {k: v for k, v in before.items()
                                                   if k.startswith("checkpoints/")}
    from opd_jax.trainers.metrics import read_metrics
    logged = [m for m in read_metrics(str(run_copy)) if m["step"] > 8]
    assert all(m["nonfinite"] == 0 for m in logged[:-1]) and logged[-1]["nonfinite"] == 1
    # The change of lr was recorded with the step it applies from.
    change = json.loads(open(run_copy / "config_changes.jsonl").read().splitlines()[-1])
    assert change["from_step"] == 8 and change["changes"]["optim.lr"]["to"] == 1e10


def _toy_state():
    return TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(3)}, rest={},
                      opt_state={"m": jnp.zeros(3)})


def _toy_step(state, batch):
    g = batch["g"]
    new = state.replace(step=state.step + 1, params={"w": state.params["w"] - g},
                        opt_state={"m": state.opt_state["m"] + g})
    return new, {"loss": jnp.sum(g), "grad_norm": jnp.linalg.norm(g)}


def test_skip_keeps_the_previous_state_and_counts():
    step = jax.jit(guard_nonfinite(_toy_step, skip=True))
    good, bad = {"g": jnp.full(3, 0.5)}, {"g": jnp.array([0.1, jnp.nan, 0.2])}
    s1, m1 = step(_toy_state(), good)
    s2, m2 = step(s1, bad)
    assert float(m1["nonfinite"]) == 0 and float(m2["nonfinite"]) == 1
    assert int(s2.step) == 2                                   # the step still counts
    np.testing.assert_array_equal(s2.params["w"], s1.params["w"])   # nothing applied
    np.testing.assert_array_equal(s2.opt_state["m"], s1.opt_state["m"])
    # Without skip the NaN goes through (and the guard has to stop the run).
    s3, m3 = jax.jit(guard_nonfinite(_toy_step))(s1, bad)
    assert float(m3["nonfinite"]) == 1 and np.isnan(np.asarray(s3.params["w"])).any()

    guard = DivergenceGuard(2, unit="optimizer step", lr=0.1)
    guard.check(1, m1)
    with pytest.warns(RuntimeWarning, match="optimizer step 2: .* skipped it \\(1 of "
                                            "train.max_bad_steps=2\\)"):
        guard.check(2, m2)
    with pytest.warns(RuntimeWarning, match="2 of train.max_bad_steps=2"):
        guard.check(5, m2)
    with pytest.raises(DivergenceError, match="diverged at optimizer step 7: loss nan, "
                                              "grad_norm nan .*after skipping optimizer "
                                              "steps \\[2, 5\\].*now 0.1"):
        guard.check(7, m2, last_checkpoint=4)
    with pytest.raises(ValueError, match="train.max_bad_steps=-1"):
        DivergenceGuard(-1)


def test_skip_knob_in_sft_bounds_the_bad_steps(run_copy):
    cfg = sft_cfg("--config.train.steps=24", "--config.optim.lr=1e10",
                  "--config.train.max_bad_steps=3")
    with pytest.warns(RuntimeWarning, match="skipped it"), \
            pytest.raises(DivergenceError, match="after skipping steps \\[\\d+, \\d+, \\d+\\]"):
        train_sft(cfg, str(run_copy), progress=False, resume_with_changes=True)
    for s in os.listdir(run_copy / "checkpoints"):     # whatever was saved is finite
        from opd_jax.checkpoint import read_step_meta
        assert read_step_meta(str(run_copy / "checkpoints" / s))["checksums"]


@pytest.mark.slow
def test_opd_divergence_stops_before_a_bad_checkpoint(tmp_path):
    """The policy trainer runs the same guard per optimizer step (OPD: the teacher signal
    gives a gradient whatever the reward)."""
    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    from tests.faults.conftest import ROOT
    from tests.trainers.test_policy_smoke import SMALL, _teacher
    teacher = _teacher(tmp_path / "teacher")
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"), SMALL + [
        "--config.train.steps=6", "--config.eval.every=0", "--config.optim.lr=1e38",
        f"--config.teachers.paths={{'general/high': '{teacher}'}}"])
    with pytest.raises(DivergenceError, match="diverged at optimizer step (\\d+): .*not "
                                              "finite.*now 1e\\+38") as e:
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    step = int(e.value.args[0].split("optimizer step ")[1].split(":")[0])
    saved = sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints"))
    assert all(s < step for s in saved)
