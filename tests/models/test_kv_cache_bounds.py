"""A KV-cache write past the cache's end raises (naming index, T and the length) where the
index is concrete, instead of XLA clamping it onto earlier slots; under jit the callers
keep room (generate/sample refuse up front, decode stops at the last slot)."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.models.helpers import random_model

from opd_jax.models import ModelConfig
from opd_jax.rollout import SamplingParams, sample

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8)
B, S = 2, 4


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


def _call(model, cache, T, start):
    tok = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(start, start + T, dtype=jnp.int32), (B, T))
    return model(tok, positions_BxT=pos, cache=cache)


def test_a_direct_write_past_the_end_raises(model):
    _, cache = _call(model, model.init_cache(B, S), 3, 0)
    assert int(cache.index) == 3
    with pytest.raises(ValueError, match=r"KV cache overflow: writing T=2 tokens at index=3 "
                                         r"needs slots \[3, 5\) but the cache length is 4"):
        _call(model, cache, 2, 3)
    _, full = _call(model, cache, 1, 3)             # exactly to the end is fine
    assert int(full.index) == S
    with pytest.raises(ValueError, match="index=4 needs slots \\[4, 5\\)"):
        _call(model, full, 1, 4)
    # a Python int index is checked too (and accepted)
    with pytest.raises(ValueError, match="index=3 needs slots \\[3, 5\\)"):
        _call(model, cache.replace(index=3), 2, 3)
    _, ok = _call(model, model.init_cache(B, S).replace(index=1), 2, 1)
    assert int(ok.index) == 3


def test_the_check_itself():
    from opd_jax.models.transformer import check_cache_room
    check_cache_room(0, 4, 4)
    check_cache_room(np.int32(2), 2, 4)
    with pytest.raises(ValueError, match="index=-1"):
        check_cache_room(-1, 1, 4)
    with pytest.raises(ValueError, match="T=5 tokens at index=0"):
        check_cache_room(jnp.zeros((), jnp.int32), 5, 4)


def test_traced_index_is_the_callers_and_overflow_shows_in_the_index(model):
    """Under jit nothing is checked on device (decode stays as fast); an overflowing call
    leaves index > max_len, which a caller can check afterwards."""
    step = nnx.jit(lambda m, c: _call(m, c, 2, 3))
    _, cache = _call(model, model.init_cache(B, S), 3, 0)
    _, over = step(model, cache)
    assert int(over.index) == 5 > over.max_len


def test_sample_refuses_and_decode_stays_in_the_cache(model):
    params = SamplingParams.create(B, temperature=1.0)
    prompt = np.ones((B, 4), np.int32)
    with pytest.raises(ValueError, match="prompt width 4 does not fit a cache of max_len=4"):
        sample(model, prompt, np.array([4, 2]), params, max_new_B=8, max_len=4)
    batch, state = sample(model, prompt[:, :3], np.array([3, 2]), params, max_new_B=100,
                          max_len=8)
    assert int(state.cache.index) <= state.cache.max_len == 8
    assert np.asarray(batch.finish_reason_B).tolist() == [2, 2]     # LENGTH
