"""Transformer: shapes, hidden/logits, KV-cache decode, packing, bf16, axis names, errors.

Forward passes go through a few module-level jitted functions at shared shapes, so the
whole file compiles about ten small programs (eager op-by-op dispatch is far slower).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tests.models.helpers import random_model, random_tokens, with_config

from opd_jax.models import KVCache, ModelConfig, Transformer

# All features on: q/k/v biases (Qwen2) and q/k norms (Qwen3) in one model.
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, arch="qwen3", qkv_bias=True)
B, T, S = 2, 9, 12  # batch, full length, cache slots


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


@nnx.jit
def fwd(m, tokens_BxT, mask_BxT):
    """(logits, hidden) of one no-cache forward with a key mask."""
    return (m(tokens_BxT, attention_mask_BxT=mask_BxT),
            m(tokens_BxT, attention_mask_BxT=mask_BxT, return_hidden=True))


@nnx.jit
def fwd_packed(m, tokens_BxT, seg_BxT):
    return m(tokens_BxT, segment_ids_BxT=seg_BxT)


@nnx.jit(donate_argnames="cache")  # as the rollout engine will: updates happen in place
def step(m, tokens_BxT, positions_BxT, mask_BxT, cache):
    return m(tokens_BxT, positions_BxT=positions_BxT, attention_mask_BxT=mask_BxT, cache=cache)


def ones(b, t):
    return jnp.ones((b, t), jnp.int32)


def test_config_roundtrip_and_errors():
    cfg = ModelConfig.preset("tiny", vocab_size=300)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert 1_000_000 <= ModelConfig.preset("tiny").num_params() <= 2_000_000
    with pytest.raises(ValueError, match=r"unknown ModelConfig keys \['bogus'\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match=r"arch 'gpt2' is not supported; expected one of"):
        cfg.replace(arch="gpt2")
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        cfg.replace(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")


# Published sizes: Qwen3-8B 8.2B, Qwen3-1.7B 1.7B (1.4B without the tied embedding).
def test_full_size_presets_under_eval_shape():
    assert ModelConfig.preset("qwen3-1.7b").num_params() == 1_720_574_976
    cfg = ModelConfig.preset("qwen3-8b")
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == cfg.num_params() == 8_190_735_360


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_param_names_its_axes(arch):
    cfg = CFG.replace(arch=arch, qkv_bias=None, tie_embeddings=arch == "qwen2")
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    paths = set()
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        names = var.get_metadata().get("out_sharding")
        assert names is not None and len(names) == len(var.get_value().shape), path
        paths.add(path[-1])
    assert ("lm_head" in paths) == (arch != "qwen2")
    assert ("q_bias" in paths) == (arch == "qwen2")
    assert ("q_norm" in {p for path, _ in nnx.to_flat_state(nnx.state(abstract))
                         for p in path}) == (arch == "qwen3")


@pytest.mark.parametrize("tie", [False, True])
def test_hidden_logits_and_causality(model, tie):
    m = with_config(model, tie_embeddings=True) if tie else model
    t = np.array(random_tokens(B, T, 64, seed=1))
    t[1, :5], t[1, 5:] = t[0, :5], (t[0, 5:] + 1) % 64  # row 1 = row 0 with a new future
    logits, hidden = fwd(m, t, ones(B, T))
    assert logits.shape == (B, T, 64) and hidden.shape == (B, T, 32)
    np.testing.assert_allclose(m.logits(hidden), logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(hidden @ m.unembedding(), logits, atol=1e-5, rtol=1e-5)
    if tie:
        np.testing.assert_array_equal(m.unembedding(), m.embed[...].T)
    np.testing.assert_allclose(logits[0, :5], logits[1, :5], atol=1e-5, rtol=1e-5)
    assert not np.allclose(logits[0, 5:], logits[1, 5:], atol=1e-3)


def test_kv_cache_decode_matches_full_forward(model):
    t = random_tokens(B, T, 64, seed=2)
    full, _ = fwd(model, t, ones(B, T))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out, cache = step(model, t[:, :4], pos[:, :4], ones(B, 4), model.init_cache(B, S))
    outs = [out]  # prefill 4 tokens at once, then one by one
    for i in range(4, T):
        old = cache
        out, cache = step(model, t[:, i:i + 1], pos[:, i:i + 1], ones(B, 1), cache)
        outs.append(out)
    assert all(k.is_deleted() for k in old.k)  # the cache was donated
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5, rtol=1e-5)
    assert int(cache.index) == T
    np.testing.assert_array_equal(cache.valid, np.arange(S)[None].repeat(B, 0) < T)


def test_kv_cache_left_padded_rows_match_unpadded_forwards(model):
    lens, P, steps = [6, 3], 6, 3
    rows = np.array(random_tokens(B, T, 64, seed=3))  # row b: prompt rows[b, :n], then more
    prompt, mask = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
    for b, n in enumerate(lens):
        prompt[b, P - n:] = rows[b, :n]
        mask[b, P - n:] = 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)  # first real token: 0
    out, cache = step(model, prompt, pos, mask, model.init_cache(B, S))
    got = [np.asarray(out[:, -1])]
    for i in range(steps):  # feed each row's true continuation
        nxt = np.asarray([[rows[b, n + i]] for b, n in enumerate(lens)], np.int32)
        out, cache = step(model, nxt, pos[:, -1:] + 1 + i, np.ones((B, 1), np.int32), cache)
        got.append(np.asarray(out[:, -1]))
    got = np.stack(got, axis=1)
    # Reference: unpadded rows (right-padded in a batch; causality ignores what follows).
    ref, _ = fwd(model, rows, ones(B, T))
    for b, n in enumerate(lens):
        np.testing.assert_allclose(got[b], ref[b, n - 1:n + steps], atol=1e-5, rtol=1e-5)
    # The no-cache path with the same mask derives the same positions itself.
    full, _ = fwd(model, prompt, mask)
    np.testing.assert_allclose(full[:, -1], got[:, 0], atol=1e-5, rtol=1e-5)


def test_segment_ids_packing_equals_separate_forwards(model):
    docs = np.array(random_tokens(B, T, 64, seed=4))  # doc a = docs[0, :5], b = docs[1, :3]
    packed = np.zeros((B, T), np.int32)
    packed[0, :5], packed[0, 5:8], packed[1] = docs[0, :5], docs[1, :3], docs[1]
    seg = np.asarray([[1] * 5 + [2] * 3 + [0], [3] * T], np.int32)
    out = fwd_packed(model, packed, seg)  # positions restart per segment
    ref, _ = fwd(model, docs, ones(B, T))
    np.testing.assert_allclose(out[0, :5], ref[0, :5], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[0, 5:8], ref[1, :3], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out[1], ref[1], atol=1e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_bf16_compute_with_fp32_params(model):
    m16 = with_config(model, dtype="bfloat16")
    assert m16.embed[...].dtype == jnp.float32
    t = random_tokens(B, T, 64, seed=5)
    out, hidden = fwd(m16, t, ones(B, T))
    assert out.dtype == hidden.dtype == jnp.bfloat16
    ref, _ = fwd(model, t, ones(B, T))
    # bf16 keeps 8 mantissa bits (2^-9 relative rounding per op); through 2 layers and the
    # unembedding the logits drift by ~1% of their scale: allow 3% of max |logit|.
    err = float(np.abs(np.asarray(out, np.float32) - np.asarray(ref)).max())
    scale = float(np.abs(np.asarray(ref)).max())
    assert err <= 0.03 * scale, (err, scale)
    assert all(k.dtype == jnp.bfloat16 for k in m16.init_cache(B, S).k)


def test_grad_through_jit_is_finite(model):
    t = random_tokens(B, T, 64, seed=6)

    def loss(m):
        logp = jax.nn.log_softmax(m(t[:, :-1]).astype(jnp.float32))
        return -jnp.take_along_axis(logp, t[:, 1:, None], axis=-1).mean()

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert all(np.abs(np.asarray(g)).max() > 0 for g in leaves)


def test_bad_inputs_raise_before_any_work(model):
    with pytest.raises(ValueError, match=r"tokens must be an int \[B, T\] array"):
        model(jnp.zeros((2, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"positions_BxT has shape \(2, 4\), expected \(2, 3\)"):
        model(jnp.zeros((2, 3), jnp.int32), positions_BxT=jnp.zeros((2, 4), jnp.int32))
    cache = model.init_cache(2, 4)
    with pytest.raises(ValueError, match="positions_BxT is required with a cache"):
        model(jnp.zeros((2, 3), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match=r"cache holds batch 2 x 4 slots"):
        model(jnp.zeros((2, 5), jnp.int32), positions_BxT=jnp.zeros((2, 5), jnp.int32),
              cache=cache)


def test_cache_is_a_pytree_with_shardings():
    from opd_jax.sharding import make_mesh
    cache = KVCache.create(CFG, batch=4, max_len=8)
    # one buffer per layer (L = 2): keys [B, K, Dh, S], values [B, K, S, Dh]
    assert len(cache.k) == len(cache.v) == 2
    assert cache.k[0].shape == (4, 2, 16, 8) and cache.v[0].shape == (4, 2, 8, 16)
    assert cache.valid_BxS.shape == (4, 8)
    assert len(jax.tree.leaves(cache)) == 2 * 2 + 2
    placed = jax.device_put(cache, cache.shardings(make_mesh((2, 2, 2))))
    P = jax.sharding.PartitionSpec
    assert placed.k[1].sharding.spec == P(("data", "fsdp"), "tensor", None, None)
    assert placed.v[1].sharding.spec == P(("data", "fsdp"), "tensor", None, None)
    assert placed.valid.sharding.spec == P(("data", "fsdp"), None)


@pytest.mark.parametrize("T", [1, 3])
def test_cached_attention_over_a_view_equals_all_slots(T):
    """A decode step's attend_cached reads the smallest cache view holding slots
    [0, index + 1), a longer append all slots: for every
    index (each view, and each boundary between two), the values are attention over all
    slots with the same mask (slots past the writes are masked), and the view really is a
    prefix: slots past it may hold anything."""
    from opd_jax.models.transformer import attend, attend_cached, cache_views
    Bq, H, K, Dh, S_ = 2, 4, 2, 8, 128
    views = cache_views(S_)
    if jax.default_backend() == "cpu":
        assert views == (64, 128)
        assert cache_views(256) == (64, 128, 192, 256)
        assert cache_views(1024) == tuple(range(128, 1025, 128))    # at most 8
        assert cache_views(127) == (127,)        # under two views of 64 slots: none
    else:
        assert views == (S_,)
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (Bq, T, H, Dh))
    k = jax.random.normal(ks[1], (Bq, K, Dh, S_))
    v = jax.random.normal(ks[2], (Bq, K, S_, Dh))
    valid = jax.random.bernoulli(ks[3], 0.8, (Bq, S_)).at[:, 0].set(True)
    cached = jax.jit(attend_cached, static_argnums=5)
    for index in range(S_ - T + 1):
        q_slot = index + jnp.arange(T)
        mask = (jnp.arange(S_)[None, None] <= q_slot[None, :, None]) & valid[:, None]
        want = attend(q, k, v, mask, jnp.float32)
        # slots past the view hold garbage it must not read (they are masked anyway)
        # (a longer append reads all slots)
        n = S_ if T > 1 else min(w for w in views if w >= index + T)
        junk = jnp.arange(S_) >= n
        k_j = jnp.where(junk, 1e4, k)
        v_j = jnp.where(junk[:, None], jnp.nan, v)
        got = cached(q, k_j, v_j, mask, jnp.int32(index), jnp.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"index {index}")
