"""SFT end to end: the step, sharded == unsharded, loss falls, kill -9 + resume is bitwise."""
import functools
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from opd_jax import sharding as sh
from opd_jax.checkpoint import Checkpointer
from opd_jax.config import load_config
from opd_jax.trainers import builders
from opd_jax.trainers.run_sft import train_sft
from opd_jax.trainers.workdir import check_workdir
from opd_jax.trainers.sft import sft_step
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config.model.hidden_size=64", "--config.model.intermediate_size=128",
        "--config.model.num_layers=2", "--config.model.head_dim=16",
        "--config.data.batch_size=8", "--config.data.seq_len=16", "--config.train.log_every=1"]


def _cfg(*extra):
    return load_config(os.path.join(ROOT, "opd_jax/configs/sft.py:tiny"), TINY + list(extra))


def _one_step(cfg, mesh, grad_accum=1):
    rules = sh.DEFAULT_RULES
    tok = builders.build_tokenizer(cfg.tokenizer)
    model = builders.build_model(cfg.model, mesh, rules, seed=0)
    batch = next(iter(builders.build_sft_dataset(cfg.data, tok)))
    tx = make_optimizer(cfg.optim, 10)
    graphdef, state = create_state(model, tx)
    state, shardings = place_state(state, mesh, rules)
    step = compile_step(functools.partial(sft_step, graphdef=graphdef, tx=tx,
                                          grad_accum=grad_accum), shardings, mesh)
    state, metrics = step(state, sh.shard_batch(batch, mesh, rules))
    return jax.device_get(state.params), jax.device_get(metrics)


def _assert_trees_close(a, b, tol):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def single_device_step():
    return _one_step(_cfg(), sh.make_mesh((1, 1, 1), devices=jax.devices()[:1]))


@pytest.mark.parametrize("shape", [pytest.param((8, 1, 1), marks=pytest.mark.slow),
                                   pytest.param((2, 4, 1), marks=pytest.mark.slow), (2, 2, 2)])
def test_sharded_step_equals_unsharded(shape, single_device_step):
    params, metrics = _one_step(_cfg(), sh.make_mesh(shape))
    ref_params, ref_metrics = single_device_step
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    _assert_trees_close(params, ref_params, 1e-5)


def test_remat_sharded_step_equals_plain_step(single_device_step):
    """model.remat="layer" composes with the sharding rules and the scan over micro-batches:
    the same loss and update as the plain single-device step."""
    params, metrics = _one_step(_cfg("--config.model.remat=layer", "--config.optim.grad_accum=2"),
                                sh.make_mesh((2, 2, 2)), grad_accum=2)
    ref_params, ref_metrics = single_device_step
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    _assert_trees_close(params, ref_params, 1e-5)


def test_grad_accumulation_is_exact(single_device_step):
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    params, metrics = _one_step(_cfg("--config.optim.grad_accum=4"), mesh, grad_accum=4)
    ref_params, ref_metrics = single_device_step
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    _assert_trees_close(params, ref_params, 1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sft")
    cfg = _cfg("--config.train.steps=60", "--config.train.ckpt_every=30",
               "--config.optim.warmup_steps=5")
    return workdir, train_sft(cfg, str(workdir), progress=False)


def test_loss_falls_and_checkpoints(trained):
    workdir, out = trained
    from opd_jax.trainers.metrics import read_metrics
    losses = [m["loss"] for m in read_metrics(str(workdir))]
    assert out["step"] == 60 and len(losses) == 60
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    assert sorted(os.listdir(workdir / "checkpoints")) == ["30", "60"]
    assert (workdir / "config.json").exists() and (workdir / "tb").is_dir()


def test_workdir_of_a_different_model_is_refused(trained):
    workdir, _ = trained
    before = sorted(os.listdir(workdir / "checkpoints"))
    stamp = os.path.getmtime(workdir / "config.json")
    with pytest.raises(ValueError, match="holds a checkpoint of a different model "
                                         "\\(differs in: num_layers\\)"):
        train_sft(_cfg("--config.train.steps=4", "--config.model.num_layers=3"), str(workdir),
                  progress=False)
    assert sorted(os.listdir(workdir / "checkpoints")) == before
    assert os.path.getmtime(workdir / "config.json") == stamp


def test_resume_with_remat_switched_on(trained, tmp_path):
    """remat is not part of the model a workdir holds: a run resumes under another value
    (and a checkpoint whose metadata predates the option is accepted too)."""
    workdir, _ = trained
    copy = tmp_path / "resumed"
    shutil.copytree(workdir, copy)
    meta = builders.planned_model_config(_cfg().model).to_dict()
    check_workdir(str(copy), {k: v for k, v in meta.items() if k != "remat"})
    out = train_sft(_cfg("--config.train.steps=62", "--config.train.ckpt_every=30",
                         "--config.optim.warmup_steps=5", "--config.model.remat=layer"),
                    str(copy), progress=False)
    assert out["step"] == 62 and np.isfinite(out["loss"])
    assert Checkpointer(str(copy / "checkpoints")).read_meta()["model"]["remat"] == "layer"


def _final_params(workdir, step):
    restored = ocp.StandardCheckpointer().restore(
        os.path.join(workdir, "checkpoints", str(step), "state"))
    return restored["params"]


def _cli(workdir, steps, *extra):
    return [sys.executable, "-m", "opd_jax", "sft", "--config",
            os.path.join(ROOT, "opd_jax/configs/sft.py:tiny"), "--workdir", str(workdir),
            "--no-progress", f"--config.train.steps={steps}", "--config.train.ckpt_every=4",
            *TINY, *extra]


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    steps = 16
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cli(full, steps), env=env, check=True, capture_output=True)

    proc = subprocess.Popen(_cli(killed, steps), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "4").is_dir():      # appears only once complete
        assert proc.poll() is None and time.time() < deadline, "run ended before checkpoint 4"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(int(s) for s in os.listdir(killed / "checkpoints") if s.isdigit())
    assert done[-1] < steps, "the kill came too late to test anything"

    subprocess.run(_cli(killed, steps), env=env, check=True, capture_output=True)
    a, b = _final_params(full, steps), _final_params(killed, steps)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_update_norm_is_the_length_of_the_step():
    """A step's ``update_norm`` (summed over steps: the path length the speed study sets
    against the distance travelled) is ||theta_1 - theta_0||. fp32 params: the step is applied
    in fp32, so the difference carries rounding of |theta| ~ 1 against a ~1e-3 step: 1e-4."""
    from flax import nnx   # lazy: this test alone reads the initial params
    cfg = _cfg("--config.optim.warmup_steps=0")
    mesh = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    start = builders.build_model(cfg.model, mesh, sh.DEFAULT_RULES, seed=0)
    before = jax.tree.leaves(jax.device_get(nnx.state(start, nnx.Param)))
    params, metrics = _one_step(cfg, mesh)
    after = jax.tree.leaves(params)
    assert len(before) == len(after)
    dist = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                       for a, b in zip(after, before)))
    assert dist > 0
    np.testing.assert_allclose(float(metrics["update_norm"]), dist, rtol=1e-4)
