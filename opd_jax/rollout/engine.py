"""The on-device rollout engine: append tokens (prefill), decode with a KV cache, pack.

Letters: B batch, S cache slots, W appended chunk width, V vocab, M stop-window length.

    state = init_state(model, batch=B, max_len=S, seed=0)
    state = extend(model, state, chunk_BxW, chunk_mask_BxW, start_turn_B=ones, max_new_B=n)
    state = decode(model, state, params, max_steps=1 << 30)   # one while_loop, one compile
    batch = pack(state)                                        # RolloutBatch

Slot layout. The cache's slots are shared by all rows (one write index); each row has its
own RoPE positions, so rows of different lengths live in the same slots with gaps masked.
The *pending* token of a row is its newest token, not yet forwarded: it sits in slot
`cache.index` of the token buffer. A decode step forwards every row's pending token into
slot `index` and samples the next one into slot `index + 1`. Rows that finished keep their
last token pending, so appending (an environment observation, a resumed history) starts
by forwarding it. `extend` takes right-aligned chunks (left padding), forwards all but the
last column and keeps the last as pending: one function is prefill, observation append,
and replay of a logged history.

RNG: the token at position p of row r uses the uniform from (seed, r, p) (see
`row_uniforms`): a row's draws do not depend on the batch, its padding, the cache layout,
or how generation was split into calls.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from opd_jax import sharding as sh
from opd_jax.models.transformer import KVCache
from opd_jax.rollout.sampling import (
    NO_BUDGET,
    NO_TOKEN,
    FinishReason,
    SamplingParams,
    row_uniforms,
    sample_logits,
)

_NO_MATCH = -2  # stop-window filler: never equals a token nor NO_TOKEN


@struct.dataclass
class RolloutState:
    """Everything generation needs between calls (a pytree of device arrays)."""
    cache: KVCache
    tokens_BxS: jax.Array       # int32 token per slot
    present_BxS: jax.Array      # bool: a real token is in this slot (pending included)
    sampled_BxS: jax.Array      # bool: sampled by the policy (the loss mask)
    forced_BxS: jax.Array       # bool: forced </think> (not sampled; excluded from the mask)
    logp_BxS: jax.Array         # fp32 sampler log-prob of sampled tokens, else 0
    pending_B: jax.Array        # int32 newest token, not yet in the cache
    pending_valid_B: jax.Array  # bool
    pos_B: jax.Array            # int32 position of the next token to forward
    active_B: jax.Array         # bool: generating in the current turn
    finish_B: jax.Array         # int32 FinishReason of the current turn
    gen_B: jax.Array            # int32 tokens generated in the current turn
    max_new_B: jax.Array        # int32 limit for the current turn
    in_think_B: jax.Array       # bool
    think_count_B: jax.Array    # int32 tokens since the last <think>
    think_budget_B: jax.Array   # int32 (NO_BUDGET = none)
    window_BxM: jax.Array       # int32 last M response tokens of this turn (stop strings)
    row_id_B: jax.Array         # int32 RNG stream per row
    key: jax.Array              # PRNG key of the job seed

    @property
    def max_len(self) -> int:
        return self.tokens_BxS.shape[1]


@struct.dataclass
class RolloutBatch:
    """Packed rollouts: row b holds its real tokens in columns [0, lengths_B[b]), then pad.

    tokens_BxL: prompt, then sampled tokens (and, multi-turn, observations) in order.
    response_mask_BxL: 1 on tokens the policy sampled (0 on prompt, padding, observations
    and forced </think>). sampler_logp_BxL: log p of each sampled token under the processed
    distribution the sampler drew from (temperature/top-k/top-p applied; 0 for greedy rows
    and off the mask). forced_mask_BxL: forced </think> tokens. prompt_lens_B: tokens
    before the first sampled one. finish_reason_B: FinishReason values.
    """
    tokens_BxL: jax.Array
    response_mask_BxL: jax.Array
    sampler_logp_BxL: jax.Array
    forced_mask_BxL: jax.Array
    attention_mask_BxL: jax.Array
    prompt_lens_B: jax.Array
    lengths_B: jax.Array
    finish_reason_B: jax.Array


def host_key(seed: int) -> jax.Array:
    """`jax.random.key(seed)` without a compile: the default threefry key of an int32 seed is
    the words [0, seed mod 2^32], wrapped from the host (other seeds and PRNG impls take
    jax.random.key). Equality with jax.random.key: tests/rollout/test_generate.py."""
    if (isinstance(seed, (int, np.integer)) and -2**31 <= int(seed) < 2**31
            and jax.config.jax_default_prng_impl == "threefry2x32"):
        return jax.random.wrap_key_data(jax.device_put(
            np.array([0, int(seed) % 2**32], np.uint32)), impl="threefry2x32")
    return jax.random.key(seed)


def init_state(model, batch: int, max_len: int, seed: int = 0, *, row_ids_B=None,
               think_budget_B=None, window: int = 8, cache_dtype=None) -> RolloutState:
    """An empty state: no tokens, cache index 0.

    The per-row fields are built on the host and put on the device (one transfer each, no
    program to compile: jnp.zeros, arange and broadcasts would each compile a small program
    on a process's first call, about 0.4-0.5 s of a 19M model's first `generate` on CPU,
    benchmarks/results/rollout_cpu.txt). Every field is its own buffer: decode and extend
    donate the state."""
    B, S = batch, max_len
    budget = NO_BUDGET if think_budget_B is None else think_budget_B
    rows = np.arange(B) if row_ids_B is None else row_ids_B
    host = dict(
        tokens_BxS=np.zeros((B, S), np.int32), present_BxS=np.zeros((B, S), bool),
        sampled_BxS=np.zeros((B, S), bool), forced_BxS=np.zeros((B, S), bool),
        logp_BxS=np.zeros((B, S), np.float32),
        **{k: np.zeros((B,), np.int32) for k in ("pending_B", "pos_B", "finish_B", "gen_B",
                                                  "max_new_B", "think_count_B")},
        **{k: np.zeros((B,), bool) for k in ("pending_valid_B", "active_B", "in_think_B")},
        think_budget_B=np.array(np.broadcast_to(np.asarray(budget, np.int32), (B,))),
        window_BxM=np.full((B, window), _NO_MATCH, np.int32),
        row_id_B=np.array(np.broadcast_to(np.asarray(rows, np.int32), (B,))))
    return RolloutState(cache=model.init_cache(B, S, cache_dtype), key=host_key(seed),
                        **jax.device_put(host))


def shard_state(state: RolloutState, mesh, rules=None) -> RolloutState:
    """Place a state on `mesh`: rows over the batch axes, cache kv heads over tensor, the
    rest replicated (the same mesh and rules as training)."""
    rules = sh.DEFAULT_RULES if rules is None else rules

    def put(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):   # placed as its raw key data
            return jax.random.wrap_key_data(sh.put(jax.random.key_data(x), sh.replicated(mesh)),
                                            impl=jax.random.key_impl(x))
        if x.ndim == 0:
            return sh.put(x, sh.replicated(mesh))
        return sh.put(x, sh.named_sharding(("batch",) + (None,) * (x.ndim - 1),
                                           x.shape, mesh, rules))
    # sh.put: also when the mesh spans several processes (same state on each).
    cache = sh.place(state.cache, state.cache.shardings(mesh, rules))
    rest = jax.tree.map(put, state.replace(cache=None))
    return rest.replace(cache=cache)


def _think_update(in_think_B, count_B, tok_B, on_B, think_ids_2):
    """Advance the think counter by one token (only where on_B)."""
    opens, closes = tok_B == think_ids_2[0], tok_B == think_ids_2[1]
    new_in = jnp.where(opens, True, jnp.where(closes, False, in_think_B))
    new_count = jnp.where(opens, 0, jnp.where(in_think_B & ~closes, count_B + 1, count_B))
    return jnp.where(on_B, new_in, in_think_B), jnp.where(on_B, new_count, count_B)


def _write_col(x_BxS, slot, col_B, on_B):
    old_B = lax.dynamic_slice_in_dim(x_BxS, slot, 1, axis=1)[:, 0]
    return lax.dynamic_update_slice_in_dim(x_BxS, jnp.where(on_B, col_B, old_B)[:, None],
                                           slot, axis=1)


def _forward(model, tokens_BxT, positions_BxT, mask_BxT, cache):
    return model(tokens_BxT, positions_BxT=positions_BxT, cache=cache,
                 attention_mask_BxT=mask_BxT)


@functools.partial(nnx.jit, donate_argnums=(1,))
def extend(model, state: RolloutState, chunk_BxW, mask_BxW, *, start_turn_B=None,
           max_new_B=None, response_BxW=None, logp_BxW=None, forced_BxW=None,
           think_ids_2=None) -> RolloutState:
    """Append right-aligned token chunks (left-padded by mask 0) to every row.

    The row's pending token is forwarded first, then all chunk columns but the last; the
    last real column becomes the new pending token (a row with an empty chunk keeps its
    pending token, unforwarded). `start_turn_B` rows begin a new turn
    (active, generation count 0, limit `max_new_B`) before the chunk is read.
    `response_BxW` / `logp_BxW` mark replayed generated tokens (WAL resume): they count as
    generated tokens of the current turn and keep their log-probs; `forced_BxW` marks
    which of them were forced </think> tokens (not sampled).
    Compiles once per (B, W, S).
    """
    B, W = chunk_BxW.shape
    zeros_BxW = jnp.zeros((B, W), bool)
    mask_BxW = mask_BxW.astype(bool)
    response_BxW = zeros_BxW if response_BxW is None else response_BxW.astype(bool) & mask_BxW
    logp_BxW = jnp.zeros((B, W), jnp.float32) if logp_BxW is None else logp_BxW
    forced_BxW = zeros_BxW if forced_BxW is None else forced_BxW.astype(bool) & response_BxW
    think_ids_2 = jnp.full((2,), NO_TOKEN, jnp.int32) if think_ids_2 is None else think_ids_2
    start_B = jnp.zeros((B,), bool) if start_turn_B is None else start_turn_B.astype(bool)
    s = state
    if max_new_B is not None:
        s = s.replace(max_new_B=jnp.where(start_B, max_new_B, s.max_new_B))
    s = s.replace(active_B=s.active_B | start_B, gen_B=jnp.where(start_B, 0, s.gen_B),
                  finish_B=jnp.where(start_B, 0, s.finish_B),
                  window_BxM=jnp.where(start_B[:, None], _NO_MATCH, s.window_BxM))
    # forward [pending, chunk[:, :-1]]: W columns starting at the shared write index. A row
    # with nothing appended keeps its pending token pending (a turn may begin without an
    # observation: decode forwards it then).
    has_B = jnp.any(mask_BxW, axis=1)
    fwd_tok_BxW = jnp.concatenate([s.pending_B[:, None], chunk_BxW[:, :-1]], axis=1)
    fwd_mask_BxW = jnp.concatenate([(s.pending_valid_B & has_B)[:, None], mask_BxW[:, :-1]],
                                   axis=1)
    fwd_pos_BxW = s.pos_B[:, None] + jnp.cumsum(fwd_mask_BxW, axis=1) - 1
    _, cache = _forward(model, fwd_tok_BxW, jnp.maximum(fwd_pos_BxW, 0), fwd_mask_BxW, s.cache)
    index = s.cache.index
    # record chunk tokens at slots index+1 .. index+W
    def put(x_BxS, new_BxW, on_BxW):
        old_BxW = lax.dynamic_slice_in_dim(x_BxS, index + 1, W, axis=1)
        return lax.dynamic_update_slice_in_dim(x_BxS, jnp.where(on_BxW, new_BxW, old_BxW),
                                               index + 1, axis=1)
    # scan the appended tokens for think markers, generated counts and the stop window
    def scan_one(carry, col):
        in_think, count, gen, window = carry
        tok_B, on_B, resp_B = col
        in_think, count = _think_update(in_think, count, tok_B, on_B, think_ids_2)
        shifted = jnp.concatenate([window[:, 1:], tok_B[:, None]], axis=1)
        window = jnp.where(resp_B[:, None], shifted, window)
        return (in_think, count, gen + resp_B, window), None
    (in_think, count, gen, window), _ = lax.scan(
        scan_one, (s.in_think_B, s.think_count_B, s.gen_B, s.window_BxM),
        (chunk_BxW.T, mask_BxW.T, response_BxW.T))
    return s.replace(
        cache=cache,
        tokens_BxS=put(s.tokens_BxS, chunk_BxW, mask_BxW),
        present_BxS=put(s.present_BxS, mask_BxW, mask_BxW),
        sampled_BxS=put(s.sampled_BxS, response_BxW & ~forced_BxW, mask_BxW),
        forced_BxS=put(s.forced_BxS, forced_BxW, mask_BxW),
        logp_BxS=put(s.logp_BxS, jnp.where(response_BxW, logp_BxW, 0.0), mask_BxW),
        pending_B=jnp.where(has_B, chunk_BxW[:, -1], s.pending_B),
        pending_valid_B=has_B | s.pending_valid_B,
        pos_B=s.pos_B + jnp.sum(fwd_mask_BxW, axis=1),
        in_think_B=in_think, think_count_B=count, gen_B=gen, window_BxM=window,
        active_B=s.active_B & (has_B | s.pending_valid_B))


def _decode_step(model, s: RolloutState, params: SamplingParams) -> RolloutState:
    """Forward the pending tokens (slot index), sample the next ones (slot index + 1)."""
    logits_Bx1xV, cache = _forward(model, s.pending_B[:, None], s.pos_B[:, None],
                                   s.pending_valid_B[:, None], s.cache)
    pos_B = s.pos_B + s.pending_valid_B
    act_B = s.active_B
    u_B = row_uniforms(s.key, s.row_id_B, pos_B)
    token_B, logp_B = sample_logits(logits_Bx1xV[:, 0], u_B, params)
    force_B = s.in_think_B & (s.think_count_B >= s.think_budget_B) & (params.think_ids_2[1] >= 0)
    token_B = jnp.where(force_B, params.think_ids_2[1], token_B)
    logp_B = jnp.where(force_B, 0.0, logp_B)
    slot = s.cache.index + 1
    in_think, count = _think_update(s.in_think_B, s.think_count_B, token_B, act_B,
                                    params.think_ids_2)
    gen_B = s.gen_B + act_B
    window = jnp.where(act_B[:, None],
                       jnp.concatenate([s.window_BxM[:, 1:], token_B[:, None]], axis=1),
                       s.window_BxM)
    # stop: a stop id, or a stop sequence equal to the window's tail
    hit_id_B = jnp.any(token_B[:, None] == params.stop_ids_N[None], axis=1)
    M = window.shape[1]
    seqs_QxM = params.stop_seqs_QxM[:, -M:]
    used_QxM = jnp.arange(seqs_QxM.shape[1])[None] >= seqs_QxM.shape[1] - params.stop_seq_len_Q[:, None]
    match_BxQ = jnp.all((window[:, None, :] == seqs_QxM[None]) | ~used_QxM[None], axis=2)
    hit_seq_B = jnp.any(match_BxQ & (params.stop_seq_len_Q > 0)[None], axis=1)
    stop_B = act_B & (hit_id_B | hit_seq_B)
    full_B = act_B & ((gen_B >= s.max_new_B) | (slot + 1 >= s.max_len))
    finish_B = jnp.where(stop_B, int(FinishReason.STOP),
                         jnp.where(full_B, int(FinishReason.LENGTH), s.finish_B))
    return s.replace(
        cache=cache,
        tokens_BxS=_write_col(s.tokens_BxS, slot, token_B, act_B),
        present_BxS=_write_col(s.present_BxS, slot, act_B, act_B),
        sampled_BxS=_write_col(s.sampled_BxS, slot, ~force_B, act_B),
        forced_BxS=_write_col(s.forced_BxS, slot, force_B, act_B),
        logp_BxS=_write_col(s.logp_BxS, slot, logp_B, act_B),
        pending_B=jnp.where(act_B, token_B, s.pending_B), pending_valid_B=act_B,
        pos_B=pos_B, active_B=act_B & ~(stop_B | full_B), finish_B=finish_B, gen_B=gen_B,
        in_think_B=in_think, think_count_B=count, window_BxM=window)


@functools.partial(nnx.jit, donate_argnums=(1,))
def decode(model, state: RolloutState, params: SamplingParams, max_steps) -> RolloutState:
    """Decode until every row stops, or `max_steps` steps (a traced per-call budget).

    One `lax.while_loop` around one decode step: compiled once per (B, S, table shapes);
    sampling knobs, stop tables and budgets are values. Rows still active afterwards are
    paused (reported as BUDGET by `pack`) and continue on the next call.
    """
    S = state.max_len

    def cond(carry):
        s, step = carry
        return jnp.any(s.active_B) & (step < max_steps) & (s.cache.index + 1 < S)

    def body(carry):
        s, step = carry
        return _decode_step(model, s, params), step + 1

    # rows without room or allowance for one more token end with LENGTH before the loop
    done_B = state.active_B & ((state.cache.index + 1 >= S) | (state.gen_B >= state.max_new_B))
    state = state.replace(
        finish_B=jnp.where(done_B, int(FinishReason.LENGTH), state.finish_B),
        active_B=state.active_B & ~done_B)
    state, _ = lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))
    return state


@jax.jit
def pack(state: RolloutState) -> RolloutBatch:
    """Gather each row's present slots into columns 0.. (gaps and pads removed)."""
    B, S = state.tokens_BxS.shape
    present = state.present_BxS
    col_BxS = jnp.where(present, jnp.cumsum(present, axis=1) - 1, S)  # S: dropped
    rows_BxS = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))

    def scatter(x_BxS, fill):
        out = jnp.full((B, S), fill, x_BxS.dtype)
        return out.at[rows_BxS, col_BxS].set(x_BxS, mode="drop")
    lengths_B = jnp.sum(present, axis=1).astype(jnp.int32)
    sampled = scatter(state.sampled_BxS & present, False)
    first_B = jnp.where(jnp.any(sampled, axis=1), jnp.argmax(sampled, axis=1), lengths_B)
    finish_B = jnp.where(state.active_B, int(FinishReason.BUDGET), state.finish_B)
    return RolloutBatch(
        tokens_BxL=scatter(state.tokens_BxS, 0), response_mask_BxL=sampled,
        sampler_logp_BxL=scatter(jnp.where(state.sampled_BxS, state.logp_BxS, 0.0), 0.0),
        forced_mask_BxL=scatter(state.forced_BxS & present, False),
        attention_mask_BxL=scatter(present, False), prompt_lens_B=first_B.astype(jnp.int32),
        lengths_B=lengths_B, finish_reason_B=finish_B.astype(jnp.int32))
