"""Token sampling: temperature, top-k, top-p, greedy, and the log-prob the sampler used.

Letters: B batch, V vocab, N stop ids, Q stop sequences, M stop-sequence length.

    params = SamplingParams.create(B, temperature=0.7, top_p=0.9, stop_token_ids=[2])
    token_B, logp_B = sample_logits(logits_BxV, u_B, params)

All knobs are arrays (traced under jit), so changing temperature, top-k, top-p or stop ids
never recompiles; only the *shapes* (B, N, Q, M) are part of the compiled program.
"""
from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from opd_jax.shapes import bucket

F32 = jnp.float32
NO_TOKEN = -1  # padding in stop-id / stop-sequence tables: never equals a real token
MAX_STOP_IDS, MAX_STOP_SEQS, MAX_STOP_LEN = 8, 4, 8  # default table shapes (grow on demand)
NO_BUDGET = np.iinfo(np.int32).max


class FinishReason(enum.IntEnum):
    """Why a row stopped. RUNNING only appears in mid-generation state."""
    RUNNING = 0
    STOP = 1    # sampled a stop id or completed a stop string (included in the output)
    LENGTH = 2  # hit its max_new_tokens or the end of the cache
    BUDGET = 3  # paused by the per-call step budget; resumable


@struct.dataclass
class SamplingParams:
    """Per-row sampling knobs and stop tables, all traced.

    temperature_B: 0 means greedy. top_k_B: 0 means off. top_p_B: 1 means off.
    stop_ids_N: token ids that end a row (NO_TOKEN padded). stop_seqs_QxM: token sequences
    that end a row, right-aligned and NO_TOKEN padded on the left; stop_seq_len_Q their
    lengths (0 = unused). think_ids_2: (<think>, </think>) ids or NO_TOKEN.
    """
    temperature_B: jax.Array
    top_k_B: jax.Array
    top_p_B: jax.Array
    stop_ids_N: jax.Array
    stop_seqs_QxM: jax.Array
    stop_seq_len_Q: jax.Array
    think_ids_2: jax.Array

    @classmethod
    def create(cls, batch: int, *, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(),
               stop_sequences=(), think_ids=(NO_TOKEN, NO_TOKEN)) -> SamplingParams:
        """Scalars broadcast to [B]; stop tables padded to power-of-two shapes (>= 8/4/8)."""
        temp = np.broadcast_to(np.asarray(temperature, np.float32), (batch,))
        top_k = np.broadcast_to(np.asarray(top_k, np.int32), (batch,))
        top_p = np.broadcast_to(np.asarray(top_p, np.float32), (batch,))
        if (temp < 0).any() or not np.isfinite(temp).all():
            raise ValueError(f"temperature={temperature}: expected finite values >= 0")
        if (top_k < 0).any():
            raise ValueError(f"top_k={top_k.tolist()}: expected >= 0 (0 = off)")
        if ((top_p <= 0) | (top_p > 1)).any():
            raise ValueError(f"top_p={top_p.tolist()}: expected values in (0, 1]")
        stop_ids = [int(t) for t in stop_token_ids]
        if any(t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids={stop_ids}: expected ids >= 0")
        seqs = [list(map(int, s)) for s in stop_sequences]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("a stop sequence is empty; expected at least one token")
        ids_N = np.full(bucket(max(len(stop_ids), MAX_STOP_IDS), 64), NO_TOKEN, np.int32)
        ids_N[:len(stop_ids)] = stop_ids
        M = bucket(max(max((len(s) for s in seqs), default=0), MAX_STOP_LEN), 64)
        seqs_QxM = np.full((bucket(max(len(seqs), MAX_STOP_SEQS), 64), M), NO_TOKEN, np.int32)
        lens_Q = np.zeros(seqs_QxM.shape[0], np.int32)
        for i, s in enumerate(seqs):
            seqs_QxM[i, M - len(s):] = s
            lens_Q[i] = len(s)
        # device_put, not jnp.asarray: that compiles a small program per shape on a
        # process's first call
        return cls(*jax.device_put((temp, top_k, top_p, ids_N, seqs_QxM, lens_Q,
                                    np.asarray(think_ids, np.int32).reshape(2))))


def _filter_sorted(logits_BxV, top_k_B, top_p_B):
    """The specification of `_filter_threshold` (same signature), by a sort: mask (to -inf)
    tokens outside the top-k, then outside the top-p nucleus of the renormalised top-k
    distribution (the HF order). Ties at the cut are broken by index."""
    B, V = logits_BxV.shape
    order_BxV = jnp.argsort(-logits_BxV, axis=-1, stable=True)
    sorted_BxV = jnp.take_along_axis(logits_BxV, order_BxV, axis=-1)
    rank_V = jnp.arange(V, dtype=jnp.int32)
    k_B = jnp.where(top_k_B > 0, top_k_B, V)
    keep_BxV = rank_V[None] < k_B[:, None]
    sorted_BxV = jnp.where(keep_BxV, sorted_BxV, -jnp.inf)
    p_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # keep token i if the mass strictly before it is < top_p (the first token always stays)
    before_BxV = jnp.cumsum(p_BxV, axis=-1) - p_BxV
    keep_BxV = keep_BxV & ((before_BxV < top_p_B[:, None]) | (rank_V[None] == 0))
    keep_unsorted_BxV = jnp.zeros((B, V), bool).at[
        jnp.arange(B)[:, None], order_BxV].set(keep_BxV)
    return jnp.where(keep_unsorted_BxV, logits_BxV, -jnp.inf)


def _ordered_key(x):
    """uint32 keys with the order of the fp32 values (negative floats reversed)."""
    bits = lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(lo_B, hi_B, ok):
    """Per row, the largest uint32 key k in [lo, hi] with ok(k), where ok holds up to some
    key and fails after, and ok(lo) holds (it is never evaluated). 32 halvings cover the
    uint32 range; mid > lo always, so keys below lo are never formed."""
    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + jnp.uint32(1)) // jnp.uint32(2)
        good = ok(mid) & (hi > lo)
        return jnp.where(good, mid, lo), jnp.where(good | (hi <= lo), hi, mid - jnp.uint32(1))
    lo, _ = lax.fori_loop(0, 32, body, (lo_B, hi_B))
    return lo


def _filter_threshold(logits_BxV, top_k_B, top_p_B):
    """Mask (to -inf) tokens outside the top-k, then outside the top-p nucleus of the
    renormalised top-k distribution, without sorting the vocabulary.

    Both cuts are value thresholds found by bisection over the fp32 bit patterns (32
    masked reductions over V each): top-k keeps the logits >= the k-th largest; top-p
    keeps the tokens v whose strictly more probable tokens hold < top_p of the mass
    (the smallest threshold t with mass(p > t) < top_p, then p >= t). Equal to
    `_filter_sorted` except where tokens tie exactly at a cut: all tied tokens are kept
    (HF's top-k rule), not the lower indices first.
    """
    B, V = logits_BxV.shape
    key_BxV = _ordered_key(logits_BxV)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth_B = _bisect(jnp.min(key_BxV, axis=-1), jnp.max(key_BxV, axis=-1),
                    lambda t_B: jnp.sum(key_BxV >= t_B[:, None], axis=-1) >= k_B)
    keep_BxV = key_BxV >= kth_B[:, None]
    p_BxV = jax.nn.softmax(jnp.where(keep_BxV, logits_BxV, -jnp.inf), axis=-1)
    pkey_BxV = _ordered_key(p_BxV)
    # mass(p > t) < top_p holds from some t on: the smallest such t is one past the
    # largest t where it fails, found as "largest t with mass(p > t - 1) >= top_p".
    mass_above = lambda t_B: jnp.sum(jnp.where(pkey_BxV > t_B[:, None], p_BxV, 0.0), axis=-1)
    zero_key_B = jnp.full((B,), _ordered_key(jnp.zeros((), F32)))
    first_ok_B = _bisect(zero_key_B, jnp.max(pkey_BxV, axis=-1),
                         lambda t_B: mass_above(t_B - jnp.uint32(1)) >= top_p_B)
    first_ok_B = jnp.where(top_p_B < 1.0, first_ok_B, zero_key_B)   # top_p = 1: no cut
    keep_BxV = keep_BxV & (pkey_BxV >= first_ok_B[:, None])
    return jnp.where(keep_BxV, logits_BxV, -jnp.inf)


def _scaled_and_filtered(logits_BxV, params: SamplingParams) -> jax.Array:
    """logits / T (greedy rows: T = 1), then top-k / top-p (-inf outside), fp32."""
    logits_BxV = logits_BxV.astype(F32)
    temp_B = params.temperature_B
    scaled_BxV = logits_BxV / jnp.where(temp_B > 0, temp_B, 1.0)[:, None]
    needs_sort = jnp.any((params.top_k_B > 0) | (params.top_p_B < 1.0))
    return lax.cond(needs_sort, lambda x: _filter_threshold(x, params.top_k_B, params.top_p_B),
                    lambda x: x, scaled_BxV)


def process_logits(logits_BxV, params: SamplingParams) -> jax.Array:
    """The sampler's log-distribution: log_softmax(filter(logits / T)) in fp32.

    Greedy rows (T = 0) keep T = 1 here; `sample_logits` takes their argmax and reports a
    log-prob of 0 (a point mass). The sort only runs when some row uses top-k or top-p.
    """
    return jax.nn.log_softmax(_scaled_and_filtered(logits_BxV, params), axis=-1)


def _block_size(V: int) -> int:
    """Vocabulary block of the two-level search: about sqrt(V), a multiple of 128."""
    return 128 * max(1, -(-int(np.ceil(np.sqrt(V))) // 128))


def _last_positive(x_BxK) -> jax.Array:
    """Index of the last entry > 0 in each row (0 when none)."""
    K = x_BxK.shape[1]
    return (K - 1 - jnp.argmax((x_BxK > 0)[:, ::-1], axis=1)).astype(jnp.int32)


# On CPU the sampler runs over SAMPLER_ROWS rows at a time (lax.map over row chunks): its
# [B, V] fp32 intermediates then stay in cache. XLA:CPU, V = 49,152, T = 1, jitted alone:
# B=64 8.5 ms whole against 1.2 ms in chunks of 16; B=32 0.69 against 0.64; B=16 0.37
# (one chunk). Off CPU the whole batch is one program (a GPU loop would only serialize).
SAMPLER_ROWS = 16


def sample_logits(logits_BxV, u_B, params: SamplingParams):
    """`sample_rows` over the batch, SAMPLER_ROWS rows at a time on CPU (the same values:
    every row's token and log-prob depend on that row alone). On CPU a batch whose rows are
    all greedy takes `greedy_rows` alone (a runtime branch of the same program: no
    recompile when the temperature changes), skipping the exponentials and sums of the
    sampling path. Off CPU the branch would cost a device-to-host copy per step."""
    if jax.default_backend() != "cpu":
        return sample_rows(logits_BxV, u_B, params)
    return lax.cond(jnp.all(params.temperature_B <= 0),
                    lambda x, u, p: greedy_rows(x), _sample_in_chunks,
                    logits_BxV, u_B, params)


def _sample_in_chunks(logits_BxV, u_B, params: SamplingParams):
    B = logits_BxV.shape[0]
    if B <= SAMPLER_ROWS:
        return sample_rows(logits_BxV, u_B, params)
    n = -(-B // SAMPLER_ROWS)
    pad = n * SAMPLER_ROWS - B

    def chunks(x_B):          # [B, ...] -> [n, SAMPLER_ROWS, ...], padded with row 0
        x_B = jnp.concatenate([x_B, jnp.broadcast_to(x_B[:1], (pad, *x_B.shape[1:]))]) \
            if pad else x_B
        return x_B.reshape(n, SAMPLER_ROWS, *x_B.shape[1:])

    def one(xs):
        logits, u, temp, top_k, top_p = xs
        return sample_rows(logits, u, params.replace(temperature_B=temp, top_k_B=top_k,
                                                     top_p_B=top_p))
    token, logp = lax.map(one, tuple(chunks(x) for x in (
        logits_BxV, u_B, params.temperature_B, params.top_k_B, params.top_p_B)))
    return token.reshape(-1)[:B], logp.reshape(-1)[:B]


def sample_rows(logits_BxV, u_B, params: SamplingParams):
    """Sample one token per row by inverse CDF with the uniform u_B in [0, 1).

    Returns (token_B, logp_B) where logp_B = log p_sampler(token) under the processed
    distribution (temperature, then top-k, then top-p); greedy rows give argmax, logp 0.
    Example: logits [0, log 3], T=1, u=0.3 -> token 1 (cdf [0.25, 1.0]), logp log 0.75.

    The token is the first whose cumulative mass exceeds u x (total mass), found in two
    levels instead of a cumulative sum over the whole vocabulary: the block (of about
    sqrt(V) tokens) whose running block total first exceeds it, then the token inside that
    block. Zero-probability tokens (filtered, or padding) are never returned. Same rule as
    `sample_logits_reference`; the two differ only where rounding moves u across a
    boundary (|u x total - cdf| ~ 1e-7 of the total).
    """
    z_BxV = _scaled_and_filtered(logits_BxV, params)
    z_BxNxS, zmax_BxN, m_B = _blocks(z_BxV)
    bs = z_BxNxS.shape[2]
    e_BxNxS = jnp.exp(z_BxNxS - m_B[:, None, None])           # filtered, padding: exactly 0
    sums_BxN = jnp.sum(e_BxNxS, axis=-1)
    cum_blocks_BxN = jnp.cumsum(sums_BxN, axis=-1)
    total_B = cum_blocks_BxN[:, -1]
    threshold_B = u_B.astype(F32) * total_B
    block_B = jnp.minimum(jnp.sum(cum_blocks_BxN <= threshold_B[:, None], axis=-1),
                          _last_positive(sums_BxN)).astype(jnp.int32)
    before_B = jnp.where(block_B > 0, jnp.take_along_axis(
        cum_blocks_BxN, jnp.maximum(block_B - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    e_BxS = jnp.take_along_axis(e_BxNxS, block_B[:, None, None], axis=1)[:, 0]
    inner_B = jnp.sum(jnp.cumsum(e_BxS, axis=-1) <= (threshold_B - before_B)[:, None], axis=-1)
    inner_B = jnp.minimum(inner_B, _last_positive(e_BxS))
    sampled_B = (block_B * bs + inner_B).astype(jnp.int32)
    # Greedy rows: top-k / top-p never drop the maximum, and greedy rows keep T = 1, so
    # this is the argmax of the raw logits.
    argmax_B = _first_max(z_BxNxS, zmax_BxN, m_B)
    greedy_B = params.temperature_B <= 0
    token_B = jnp.where(greedy_B, argmax_B, sampled_B)
    z_tok_B = jnp.take_along_axis(z_BxV, token_B[:, None], axis=-1)[:, 0]
    logp_B = z_tok_B - m_B - jnp.log(total_B)
    return token_B, jnp.where(greedy_B, 0.0, logp_B)


def _blocks(z_BxV):
    """[B, V] -> ([B, nb, bs] padded with -inf, the block maxima [B, nb], the row maxima
    [B]), bs = `_block_size(V)`."""
    B, V = z_BxV.shape
    bs = _block_size(V)
    nb = -(-V // bs)
    z_BxNxS = jnp.pad(z_BxV, ((0, 0), (0, nb * bs - V)),
                      constant_values=-jnp.inf).reshape(B, nb, bs)
    zmax_BxN = jnp.max(z_BxNxS, axis=-1)
    return z_BxNxS, zmax_BxN, jnp.max(zmax_BxN, axis=-1)


def _first_max(z_BxNxS, zmax_BxN, m_B) -> jax.Array:
    """The first maximum of each row (jnp.argmax's rule) in two levels, since XLA's CPU
    argmax over [B, V] is a slow index-carrying reduce: the first block holding the row
    maximum, then the first position in it."""
    bs = z_BxNxS.shape[2]
    gblock_B = jnp.argmax(zmax_BxN == m_B[:, None], axis=-1).astype(jnp.int32)
    z_blk_BxS = jnp.take_along_axis(z_BxNxS, gblock_B[:, None, None], axis=1)[:, 0]
    return gblock_B * bs + jnp.argmax(z_blk_BxS == m_B[:, None], axis=-1).astype(jnp.int32)


def greedy_rows(logits_BxV):
    """(token_B, logp_B) of a batch of greedy rows: the first argmax of the raw logits, and
    log-prob 0 (a point mass), as `sample_rows` gives them."""
    z_BxNxS, zmax_BxN, m_B = _blocks(logits_BxV.astype(F32))
    return _first_max(z_BxNxS, zmax_BxN, m_B), jnp.zeros(logits_BxV.shape[:1], F32)


def sample_logits_reference(logits_BxV, u_B, params: SamplingParams):
    """The specification of `sample_logits` (same signature): one cumulative sum over the
    whole processed distribution, the first token whose cdf exceeds u x cdf[-1]."""
    logp_BxV = process_logits(logits_BxV, params)
    cdf_BxV = jnp.cumsum(jnp.exp(logp_BxV), axis=-1)
    threshold_B = u_B.astype(F32) * cdf_BxV[:, -1]
    sampled_B = jnp.sum(cdf_BxV <= threshold_B[:, None], axis=-1).astype(jnp.int32)
    sampled_B = jnp.minimum(sampled_B, logits_BxV.shape[-1] - 1)
    greedy_B = params.temperature_B <= 0
    token_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), sampled_B)
    logp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B, jnp.where(greedy_B, 0.0, logp_B)


def row_uniforms(key, row_ids_B, positions_B):
    """u_B ~ U[0, 1) from the stream (key, row id, position): independent of batch
    composition, padding and pauses, so a resumed row draws the same numbers."""
    def one(row, pos):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, row), pos))
    return jax.vmap(one)(row_ids_B, positions_B)
