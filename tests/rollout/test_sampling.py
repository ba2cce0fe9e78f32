"""Sampling rules against their definitions: chi-square on a small vocabulary, greedy, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from opd_jax.rollout import SamplingParams, process_logits, sample_logits

LOGITS_V = np.log(np.array([0.30, 0.25, 0.15, 0.12, 0.10, 0.05, 0.03], np.float64))
N = 20_000


def reference_probs(logits_V, temperature=1.0, top_k=0, top_p=1.0):
    """numpy spec: softmax(logits / T), keep top-k, renormalise, keep the smallest prefix
    of the sorted list whose mass reaches top_p, renormalise."""
    p = np.exp(logits_V / temperature - np.max(logits_V / temperature))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    keep[order[:top_k or len(p)]] = True
    q = np.where(keep, p, 0.0) / p[keep].sum()
    mass = 0.0
    for i in order:
        if not keep[i]:
            continue
        if mass >= top_p:
            keep[i] = False
        mass += q[i]
    q = np.where(keep, q, 0.0)
    return q / q.sum()


@jax.jit
def draw(logits_V, u_N, temperature, top_k, top_p):
    params = SamplingParams.create(1, temperature=1.0)
    params = params.replace(temperature_B=jnp.full((N,), temperature),
                            top_k_B=jnp.full((N,), top_k, jnp.int32),
                            top_p_B=jnp.full((N,), top_p))
    return sample_logits(jnp.broadcast_to(logits_V, (N, logits_V.shape[0])), u_N, params)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6),
    (0.7, 5, 0.8)])
def test_chi_square_matches_definition(temperature, top_k, top_p):
    u_N = jax.random.uniform(jax.random.key(7), (N,))
    tok_N, logp_N = draw(jnp.asarray(LOGITS_V, jnp.float32), u_N, temperature, top_k, top_p)
    expected = reference_probs(LOGITS_V, temperature, top_k, top_p)
    counts = np.bincount(np.asarray(tok_N), minlength=len(LOGITS_V))
    support = expected > 0
    assert counts[~support].sum() == 0  # never a filtered token
    assert stats.chisquare(counts[support], N * expected[support]).pvalue > 1e-3
    # returned log-probs are those of the processed distribution
    np.testing.assert_allclose(np.asarray(logp_N), np.log(expected[np.asarray(tok_N)]),
                               atol=1e-5)
    if top_k or top_p < 1:  # power check: the unfiltered distribution is rejected
        plain = reference_probs(LOGITS_V, temperature)
        assert stats.chisquare(counts, N * plain).pvalue < 1e-6


def test_greedy_and_process_logits():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 11)), jnp.float32)
    params = SamplingParams.create(3, temperature=[0.0, 1.0, 0.5], top_k=[0, 2, 0],
                                   top_p=[1.0, 1.0, 0.5])
    tok, logp = sample_logits(logits, jnp.array([0.5, 0.999, 0.0]), params)
    assert int(tok[0]) == int(jnp.argmax(logits[0])) and float(logp[0]) == 0.0
    lp = np.asarray(process_logits(logits, params))
    assert np.isfinite(lp[1]).sum() == 2 and np.isclose(np.exp(lp[1]).sum(), 1.0, atol=1e-6)
    np.testing.assert_allclose(lp[1, int(tok[1])], float(logp[1]), atol=1e-6)
    kept = np.flatnonzero(np.isfinite(lp[2]))  # inverse CDF: u=0 takes the first kept id
    assert int(tok[2]) == kept[0] and int(jnp.argmax(logits[2])) in kept


def test_params_errors():
    with pytest.raises(ValueError, match=r"temperature=-1.0: expected finite values >= 0"):
        SamplingParams.create(2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p=\[0.0, 0.0\]: expected values in \(0, 1\]"):
        SamplingParams.create(2, top_p=0.0)
    with pytest.raises(ValueError, match=r"top_k=\[-1, -1\]"):
        SamplingParams.create(2, top_k=-1)
    with pytest.raises(ValueError, match="stop sequence is empty"):
        SamplingParams.create(2, stop_sequences=[[]])
    p = SamplingParams.create(2, stop_token_ids=list(range(9)), stop_sequences=[[1] * 9])
    assert p.stop_ids_N.shape == (16,) and p.stop_seqs_QxM.shape == (4, 16)


@pytest.mark.parametrize("V,temperature,top_k,top_p", [
    (128, 1.0, 0, 1.0), (1000, 0.7, 0, 1.0), (32_000, 1.0, 0, 1.0), (32_000, 1.3, 50, 0.9),
    (5_003, 1.0, 0, 0.5)])
def test_two_level_search_equals_the_reference(V, temperature, top_k, top_p):
    """The two-level inverse CDF picks the reference's token (one cumsum over V) except
    where fp32 rounding puts u within 1e-6 of a cdf boundary (checked in float64), never a
    zero-probability token, and reports the same log-prob."""
    from opd_jax.rollout.sampling import sample_logits_reference
    B = 256
    logits = jax.random.normal(jax.random.key(V), (B, V)) * 3.0
    u_B = jax.random.uniform(jax.random.key(V + 1), (B,))
    params = SamplingParams.create(B, temperature=temperature, top_k=top_k, top_p=top_p)
    tok, logp = jax.jit(sample_logits)(logits, u_B, params)
    ref_tok, ref_logp = jax.jit(sample_logits_reference)(logits, u_B, params)
    lp = np.asarray(process_logits(logits, params), np.float64)
    tok, ref_tok = np.asarray(tok), np.asarray(ref_tok)
    assert np.isfinite(lp[np.arange(B), tok]).all()          # never a filtered token
    np.testing.assert_allclose(np.asarray(logp), lp[np.arange(B), tok], atol=1e-5)
    for b in np.flatnonzero(tok != ref_tok):
        cdf = np.cumsum(np.exp(lp[b]))
        cdf /= cdf[-1]
        edge = cdf[min(tok[b], ref_tok[b])]       # the boundary between the two picks
        assert abs(edge - float(u_B[b])) < 1e-6, (b, tok[b], ref_tok[b], edge, float(u_B[b]))
    assert (tok == ref_tok).mean() >= 0.98
    np.testing.assert_allclose(np.asarray(logp)[tok == ref_tok],
                               np.asarray(ref_logp)[tok == ref_tok], atol=1e-5)


@pytest.mark.parametrize("B", [17, 37, 64])
def test_row_chunks_give_every_row_what_the_whole_batch_gives(B):
    """On CPU, sample_logits runs SAMPLER_ROWS rows at a time (the last chunk padded): the
    same tokens and log-probs as `sample_rows` over the whole batch, per-row temperature
    (greedy included), top-k and top-p kept with their rows."""
    from opd_jax.rollout.sampling import SAMPLER_ROWS, sample_rows
    assert B > SAMPLER_ROWS
    V = 1_000
    logits = jax.random.normal(jax.random.key(B), (B, V)) * 3.0
    u_B = jax.random.uniform(jax.random.key(B + 1), (B,))
    r = np.random.default_rng(B)
    params = SamplingParams.create(B, temperature=r.choice([0.0, 0.7, 1.0, 1.5], B),
                                   top_k=r.choice([0, 5, 50], B), top_p=r.choice([1.0, 0.8], B))
    tok, logp = jax.jit(sample_logits)(logits, u_B, params)
    want_tok, want_logp = jax.jit(sample_rows)(logits, u_B, params)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want_logp), rtol=1e-6, atol=1e-6)
    assert tok.shape == (B,) and (np.asarray(params.temperature_B) == 0).any()
    # a batch of greedy rows only takes the argmax branch: what sample_rows gives them
    greedy = SamplingParams.create(B, temperature=0.0, top_k=r.choice([0, 5], B))
    tok, logp = jax.jit(sample_logits)(logits, u_B, greedy)
    want_tok, want_logp = jax.jit(sample_rows)(logits, u_B, greedy)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
    assert not np.asarray(logp).any() and not np.asarray(want_logp).any()


@pytest.mark.parametrize("V", [7, 128, 1000, 32_000])
def test_threshold_filter_equals_the_sorted_one(V):
    """top-k / top-p by bisection over the fp32 bit patterns keeps exactly the tokens the
    sort-based specification keeps (random logits: no ties at the cut), for per-row k
    (0 = off) and top_p (1 = off); with ties at a cut, every tied token is kept."""
    from opd_jax.rollout.sampling import _filter_sorted, _filter_threshold
    B = 16
    for seed in range(3):
        logits = jax.random.normal(jax.random.key(seed), (B, V)) * 3.0
        top_k = jax.random.randint(jax.random.key(seed + 10), (B,), 0, min(V, 60))
        top_p = jax.random.uniform(jax.random.key(seed + 20), (B,), minval=0.05, maxval=1.0)
        top_p = top_p.at[0].set(1.0)
        want = np.isfinite(np.asarray(jax.jit(_filter_sorted)(logits, top_k, top_p)))
        got_logits = np.asarray(jax.jit(_filter_threshold)(logits, top_k, top_p))
        np.testing.assert_array_equal(np.isfinite(got_logits), want)
        np.testing.assert_array_equal(got_logits[want], np.asarray(logits)[want])
    tied = jnp.asarray([[1.0, 3.0, 2.0, 3.0, 0.0]])
    kept = np.isfinite(np.asarray(_filter_threshold(tied, jnp.asarray([1]), jnp.asarray([1.0]))))
    np.testing.assert_array_equal(kept[0], [False, True, False, True, False])


def test_greedy_is_the_first_maximum():
    """Greedy rows return jnp.argmax of the raw logits (first index on ties), also with
    top-k / top-p set and across block boundaries."""
    B, V = 64, 5_003
    logits = jax.random.normal(jax.random.key(3), (B, V))
    logits = logits.at[0, 4_000].set(9.0).at[0, 4_500].set(9.0)       # tie: first wins
    logits = logits.at[1, V - 1].set(9.0)                               # last (padded) block
    params = SamplingParams.create(B, temperature=0.0, top_k=[0, 5] * (B // 2),
                                   top_p=[1.0, 0.5] * (B // 2))
    tok, logp = jax.jit(sample_logits)(logits, jnp.full((B,), 0.5), params)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(jnp.argmax(logits, axis=-1)))
    assert int(tok[0]) == 4_000 and int(tok[1]) == V - 1 and not np.asarray(logp).any()
