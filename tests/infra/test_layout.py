"""The run's device path as one object (`sharding.Layout`): a minibatch gathered on device
lands in the batch sharding of the run's rules, and the compiled train step reads the same
rules (a batch axis mapped elsewhere than the default is honoured, not re-laid out)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from opd_jax import sharding as sh
from opd_jax.models import ModelConfig
from opd_jax.trainers.state import TrainState, compile_step, create_state, place_state
from tests.models.helpers import random_model

RULES = tuple((k, "fsdp") if k == "batch" else (k, v) for k, v in sh.DEFAULT_RULES)


def test_take_rows_gathers_on_device_into_the_batch_sharding():
    layout = sh.Layout(sh.make_mesh((2, 4, 1)), [list(r) for r in RULES])   # config lists
    rng = np.random.default_rng(0)
    host = {"x": rng.normal(size=(16, 5)).astype(np.float32),
            "t": (rng.normal(size=(16, 3, 2)).astype(np.float32),)}
    batch = layout.shard_batch(host)
    idx = np.array([9, 1, 4, 12, 0, 7, 3, 15])
    sub = layout.take_rows(batch, idx)
    np.testing.assert_array_equal(np.asarray(sub["x"]), host["x"][idx])
    np.testing.assert_array_equal(np.asarray(sub["t"][0]), host["t"][0][idx])
    assert sub["x"].sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert sub["t"][0].sharding.spec == jax.sharding.PartitionSpec("fsdp", None, None)
    assert layout.batch_shards == 4
    before = sh._take_rows_fn.cache_info().misses
    layout.take_rows(batch, idx[::-1])                 # same structure: no new program
    assert sh._take_rows_fn.cache_info().misses == before


def test_compiled_step_takes_the_batch_where_the_rules_put_it():
    mesh = sh.make_mesh((2, 4, 1))
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)
    _, state = create_state(random_model(cfg, seed=0), optax.sgd(0.1))
    state, shardings = place_state(state, mesh, RULES)

    def step(state: TrainState, batch):
        return state.replace(step=state.step + 1), {"loss": jnp.mean(batch["x"]),
                                                    "grad_norm": jnp.float32(0.0)}

    batch = sh.shard_batch({"x": np.ones((8, 4), np.float32)}, mesh, RULES)
    _, m = compile_step(step, shardings, mesh, rules=RULES, donate=False)(state, batch)
    assert float(m["loss"]) == 1.0
    # A step compiled under other rules (what the trainers did before the rules reached
    # it) refuses the batch the run placed.
    with pytest.raises(ValueError, match="does not match the sharding"):
        compile_step(step, shardings, mesh, donate=False)(state, batch)
