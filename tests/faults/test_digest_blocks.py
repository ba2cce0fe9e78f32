"""Checkpoint checksums computed in blocks: the same values as the whole-array formula,
with temporaries bounded by a block (a whole-array uint32 copy of every leaf of a train
state was 4.4 GiB of XLA temporaries for a 151k x 2048 embedding and its Adam moments)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.checkpoint import _leaf_digest, state_digest


def _reference(x):
    """The checksum as first defined: one pass over the whole array's uint32 words."""
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    elif x.dtype.itemsize >= 4:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        u = jax.lax.bitcast_convert_type(
            x, {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]).astype(jnp.uint32)
    u = u.reshape(-1)
    w = jnp.arange(u.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True
    return int(jnp.sum((u ^ (u >> 15)) * w, dtype=jnp.uint32)), bool(finite)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32,
                                   jnp.bool_, jnp.uint8])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_block_digest_equals_whole_array_digest(dtype, bad):
    rng = np.random.default_rng(0)
    for shape in ((), (0,), (7,), (64, 33), (5, 4, 3)):
        v = rng.standard_normal(shape) * 100
        if bad is not None and v.size:
            v.reshape(-1)[v.size // 2] = bad
        x = jnp.asarray(v).astype(dtype)
        want = _reference(x)
        for block in (1, 4, 7, 64, 1 << 22):
            d, f = _leaf_digest(x, block)
            assert (int(d), bool(f)) == want, (shape, block)


def test_state_digest_names_the_nonfinite_leaf():
    tree = {"a": jnp.ones((10,)), "b": {"c": jnp.asarray([1.0, jnp.nan], jnp.bfloat16)}}
    sums, bad = state_digest(tree)
    assert bad == ["['b']['c']"]
    assert sums["['a']"] == _reference(tree["a"])[0]


@pytest.mark.parametrize("dtype,limit", [(jnp.float32, 64 << 20), (jnp.bfloat16, None)])
def test_digest_temporaries_are_bounded(dtype, limit):
    """Compiled for a Llama-stand-in embedding (nothing allocated): fp32 needs only block
    temporaries; bf16 one copy of its bits (sliced as bf16, XLA's CPU backend would carry
    it through the loop widened to fp32: twice the array)."""
    s = jax.ShapeDtypeStruct((151_669, 2048), dtype)
    temp = _leaf_digest.lower(s).compile().memory_analysis().temp_size_in_bytes
    nbytes = 151_669 * 2048 * jnp.dtype(dtype).itemsize
    assert temp <= (limit if limit is not None else 1.1 * nbytes), temp
