"""Issue 30, early estimates: a seq_len or batch whose training step cannot fit in memory is
refused with the estimate before anything is compiled (it compiled for 30 s and died with a
raw 15 TB allocation); within 20% of the memory it warns."""
import pytest

from opd_jax.cli import main
from opd_jax.config import load_config
from opd_jax.trainers import builders, memory
from tests.faults.conftest import SFT, TINY

LONG = ["--config.model.max_position_embeddings=1048576", "--config.data.seq_len=1048576"]


def test_a_step_that_cannot_fit_is_refused_with_its_estimate(tmp_path, capfd):
    workdir = tmp_path / "run"
    assert main(["sft", "--config", SFT, *TINY, *LONG, "--workdir", str(workdir),
                 "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: data.seq_len=1048576 x 1 rows per device: the training step "
                          "is estimated at ") and " TiB over 8 CPU devices (activations " in err
    assert "more than the " in err and "of host memory; expected a shorter sequence" in err
    assert not workdir.exists()


def test_a_step_close_to_the_memory_warns(monkeypatch):
    cfg = load_config(SFT, TINY)
    mesh, rules, _, model_config = builders.setup(cfg)
    est = memory.step_memory(cfg, model_config, 8)
    need = est.total * 8                       # 8 fake CPU devices share the host
    with pytest.warns(RuntimeWarning, match="within 20% of the .* of host memory"):
        memory.check_memory(cfg, model_config, 8, memory=(int(need / 0.9), "host memory"))
    memory.check_memory(cfg, model_config, 8, memory=(int(need / 0.7), "host memory"))
    with pytest.raises(ValueError, match="more than the"):
        memory.check_memory(cfg, model_config, 8, memory=(need - 1, "host memory"))


def _xla_step_bytes(cfg, model_config) -> int:
    """XLA:CPU's compiled SFT step on one device: arguments + outputs + temporaries."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from opd_jax.models import Transformer
    from opd_jax.trainers.sft import sft_step
    from opd_jax.trainers.state import create_state, make_optimizer
    model = Transformer(model_config, rngs=nnx.Rngs(0))
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    graphdef, state = create_state(model, tx)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32)
             for k in ("inputs", "targets", "mask", "segment_ids", "positions")}
    step = jax.jit(functools.partial(sft_step, graphdef=graphdef, tx=tx))
    mem = step.lower(state, batch).compile().memory_analysis()
    return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes


@pytest.mark.parametrize("seq_len, batch", [(256, 8), (64, 32)])
def test_the_estimate_is_within_a_factor_two_of_xla(seq_len, batch):
    """The analytic estimate against XLA:CPU's compiled SFT step (the tiny preset's model):
    of the right size to refuse what cannot fit."""
    cfg = load_config(SFT, [f"--config.data.seq_len={seq_len}",
                            f"--config.data.batch_size={batch}"])
    model_config = builders.model_config_from(cfg.model)
    est = memory.step_memory(cfg, model_config, 1).total
    xla = _xla_step_bytes(cfg, model_config)
    assert 0.5 <= est / xla <= 2.0, (est, xla)


def test_policy_runs_are_estimated_at_their_fixed_seq_len_only(tmp_path, capfd):
    """A bucketed run (rollout.seq_len=0) is not refused on its max_new_tokens x max_turns
    bound (the main job's teachers: 2240 tokens, real rows ~100); a fixed seq_len is."""
    from tests.faults.test_inputs import GRPO
    cfg = load_config(GRPO, ["--config.rollout.sampling.max_new_tokens=224",
                             "--config.rollout.sampling.max_turns=10"])
    mesh, rules, _, model_config = builders.setup(cfg)
    assert memory.check_memory(cfg, model_config, 8, memory=(1, "host memory")) is None
    assert main(["grpo", "--config", GRPO, "--config.model.max_position_embeddings=1048576",
                 "--config.rollout.seq_len=1048576", "--workdir", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    assert capfd.readouterr().err.startswith("error: rollout.seq_len=1048576 x 4 rows per "
                                             "device: the training step is estimated at ")
