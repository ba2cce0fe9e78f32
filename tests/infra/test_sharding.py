import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from opd_jax import sharding as sh


def test_make_mesh_shapes():
    assert dict(sh.make_mesh((-1, 1, 1)).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(sh.make_mesh((2, -1, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="needs 12 devices, have 8"):
        sh.make_mesh((3, 4, 1))
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sh.make_mesh((-1, -1, 1))
    with pytest.raises(ValueError, match="not divisible by 3"):
        sh.make_mesh((3, -1, 1))


def test_logical_to_spec_rules():
    mesh = sh.make_mesh((2, 2, 2))
    assert sh.logical_to_spec(("embed", "mlp"), mesh=mesh) == P("fsdp", "tensor")
    assert sh.logical_to_spec(("batch", "seq"), mesh=mesh) == P(("data", "fsdp"), None)
    # A mesh axis is used once; size-1 axes are dropped.
    assert sh.logical_to_spec(("batch", "embed"), mesh=mesh) == P(("data", "fsdp"), None)
    assert sh.logical_to_spec(("embed", "mlp"), mesh=sh.make_mesh((8, 1, 1))) == P(None, None)
    with pytest.raises(KeyError, match="logical axis 'bogus' has no sharding rule"):
        sh.logical_to_spec(("bogus",))


def test_indivisible_dims_fall_back_to_replication():
    mesh = sh.make_mesh((1, 2, 4))
    s = sh.named_sharding(("kv_heads", "embed"), (2, 6), mesh)   # 2 kv heads on tensor=4
    assert s.spec == P(None, "fsdp")


class _Two(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 16)),
                           sharding_names=("embed", "mlp"), eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((16,)), sharding_names=("mlp",), eager_sharding=False)


def test_init_sharded_equals_plain_init():
    mesh = sh.make_mesh((2, 2, 2))
    m = sh.init_sharded(lambda: _Two(nnx.Rngs(0)), mesh)
    ref = _Two(nnx.Rngs(0))
    assert m.w[...].sharding.spec == P("fsdp", "tensor")
    assert m.b[...].sharding.spec == P("tensor")
    np.testing.assert_array_equal(np.asarray(m.w[...]), np.asarray(ref.w[...]))


def test_shard_batch_checks_divisibility():
    mesh = sh.make_mesh((2, 2, 2))
    out = sh.shard_batch({"x": np.ones((8, 3), np.int32)}, mesh)
    assert out["x"].sharding.spec == P(("data", "fsdp"), None)
    with pytest.raises(ValueError, match="batch dimension 6 is not divisible by the 4 devices"):
        sh.shard_batch({"x": np.ones((6, 3))}, mesh)
