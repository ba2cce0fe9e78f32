"""Public entry points: `sample` (on device, for trainers) and `generate` (lists in, lists out).

Letters: B batch, P prompt columns, S cache slots, L packed length (= S).

    res = generate(model, [[1, 5, 7], [1, 9]], max_new_tokens=32, temperature=0.8, seed=0)
    res.tokens[0], res.logprobs[0], res.finish_reasons[0]      # new ids, log-probs, "stop"

    batch, state = sample(model, prompt_BxP, prompt_lens_B, params, seed=0,
                          max_new_B=max_new_B, max_len=256)      # no host round trip
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.distributed import fetch
from opd_jax.rollout import engine
from opd_jax.shapes import bucket
from opd_jax.rollout.sampling import NO_BUDGET, NO_TOKEN, FinishReason, SamplingParams

FINISH_NAMES = {int(r): r.name.lower() for r in FinishReason}
ALL_STEPS = (1 << 31) - 1


def _array_module(*xs):
    """jnp when any of `xs` is a device array (or a tracer), else np: host inputs stay on
    the host until a jitted call takes them (an eager jnp op compiles a program on a
    process's first call)."""
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


def align_right(prompt_BxP, prompt_lens_B, padding: str = "left"):
    """(tokens, mask) with each row's prompt ending in the last column.

    padding="left": prompts are already right-aligned; "right": prompts start at column 0.
    Host (numpy) inputs are aligned on the host, device arrays on the device.
    """
    if padding not in ("left", "right"):
        raise ValueError(f"padding={padding!r}: expected 'left' or 'right'")
    xp = _array_module(prompt_BxP, prompt_lens_B)
    P = prompt_BxP.shape[1]
    col_P = xp.arange(P, dtype=np.int32)
    mask_BxP = col_P[None] >= (P - prompt_lens_B)[:, None]
    if padding == "left":
        return prompt_BxP, mask_BxP
    src_BxP = (col_P[None] - (P - prompt_lens_B)[:, None]) % P
    return xp.take_along_axis(prompt_BxP, src_BxP, axis=1), mask_BxP


def sample(model, prompt_BxP, prompt_lens_B, params: SamplingParams, *, seed=0,
           max_new_B, max_len: int, think_budget_B=None, row_ids_B=None,
           padding: str = "left", max_steps=ALL_STEPS, cache_dtype=None, mesh=None):
    """Prefill the prompts and decode; returns (RolloutBatch, RolloutState), all on device.

    prompt_BxP: int32 prompts, left-padded (right-aligned) or right-padded (`padding`).
    max_new_B / think_budget_B: per-row limits (think budget: tokens between <think> and
    </think>, then </think> is forced; `sampling.NO_BUDGET` = none). max_len: cache slots S
    (static). max_steps: per-call decode budget (traced); paused rows report BUDGET and
    continue with `resume(model, state, params, max_steps)`. Rows draw from
    (seed, row_ids_B[b], position) streams. Changing params, budgets, seed or the prompts'
    values never recompiles; B, P, S and the stop-table shapes do. mesh: place the state
    on it (rows over data/fsdp, cache heads over tensor; shard the model with
    `opd_jax.sharding.shard_model` / `init_sharded` on the same mesh).
    """
    B, P = prompt_BxP.shape
    if P + 1 > max_len:
        raise ValueError(f"prompt width {P} does not fit a cache of max_len={max_len} "
                         f"(need max_len >= prompt width + 1)")
    xp = _array_module(prompt_BxP, prompt_lens_B)
    tok_BxP, mask_BxP = align_right(xp.asarray(prompt_BxP, np.int32),
                                    xp.asarray(prompt_lens_B, np.int32), padding)
    state = engine.init_state(model, B, max_len, seed, row_ids_B=row_ids_B,
                              think_budget_B=think_budget_B, window=params.stop_seqs_QxM.shape[1],
                              cache_dtype=cache_dtype)
    if mesh is not None:
        state = engine.shard_state(state, mesh)
    state = engine.extend(model, state, tok_BxP, mask_BxP, start_turn_B=np.ones((B,), bool),
                          max_new_B=np.array(np.broadcast_to(np.asarray(max_new_B, np.int32),
                                                             (B,))),
                          think_ids_2=params.think_ids_2)
    return resume(model, state, params, max_steps)


def resume(model, state, params: SamplingParams, max_steps=ALL_STEPS):
    """Continue paused rows for at most `max_steps` decode steps; (RolloutBatch, state)."""
    state = engine.decode(model, state, params,
                          _array_module(max_steps).asarray(max_steps, np.int32))
    return engine.pack(state), state


@dataclasses.dataclass
class GenerateResult:
    """Per row: new token ids, their sampler log-probs, and a finish reason
    ("stop", "length" or "budget"); `batch` is the packed RolloutBatch (device arrays)."""
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    batch: engine.RolloutBatch


def stop_sequences(tokenizer, stop_strings: Sequence[str]) -> list[list[int]]:
    """Token sequences of stop strings; each must encode to known tokens that decode back.

    A stop string matches when the sampled ids end with its canonical tokenization (exact
    for char-level tokenizers and special tokens; a BPE model that spells the string with
    other pieces is not caught).
    """
    if stop_strings and tokenizer is None:
        raise ValueError(f"stop_strings={list(stop_strings)} need a tokenizer= to tokenize them")
    out = []
    for text in stop_strings:
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop string {text!r}: expected a non-empty str")
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        unk = getattr(tokenizer, "unk_token_id", None)
        back = tokenizer.decode(ids)
        if not ids or (unk is not None and unk in ids) or back != text:
            raise ValueError(f"stop string {text!r} tokenizes to {ids}, which decodes to "
                             f"{back!r}; expected known tokens that decode to the string")
        out.append(ids)
    return out


def think_ids(tokenizer, markers=("<think>", "</think>")) -> tuple[int, int]:
    """(<think>, </think>) ids from a tokenizer; raises if it lacks them."""
    ids = tuple(tokenizer.convert_tokens_to_ids(m) for m in markers)
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        raise ValueError(f"tokenizer has no think markers {markers} (ids {ids})")
    return ids


def _per_row(name: str, value, B: int, allow_none: bool = False) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * B
    if len(values) != B:
        raise ValueError(f"{name} has {len(values)} entries, expected one per prompt ({B})")
    for v in values:
        if v is None and allow_none:
            continue
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}={v!r}: expected an int >= 0"
                             + (" or None" if allow_none else ""))
    return values


def check_prompts(prompts, vocab_size: int) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; expected at least one token")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {vocab_size})")


def generate(model, prompts: list[list[int]], *, max_new_tokens, temperature=1.0, top_k=0,
             top_p=1.0, stop_token_ids=(), stop_strings=(), tokenizer=None, seed=0,
             think_budget=None, think_token_ids=None, max_len=None, row_ids=None,
             steps_per_call=None, mesh=None) -> GenerateResult:
    """Sample continuations of `prompts` (lists of ids); see `sample` for the semantics.

    max_new_tokens / think_budget: an int or one per prompt (think budget None = none;
    it needs `think_token_ids` or a tokenizer with <think>/</think>). max_len: cache slots
    (default: bucketed longest prompt + max_new_tokens + 1). steps_per_call: decode in
    chunks of this many steps (paused rows resume). (A killed rollout resumes from a token
    log in the episode runner, `opd_jax.episodes.play(wal_path=)`.)
    mesh: shard rows and the cache on it (the model should be sharded on it too).
    """
    check_prompts(prompts, model.config.vocab_size)
    B = len(prompts)
    max_new = _per_row("max_new_tokens", max_new_tokens, B)
    budgets = _per_row("think_budget", think_budget, B, allow_none=True)
    if any(b is not None for b in budgets) and think_token_ids is None:
        if tokenizer is None:
            raise ValueError("think_budget needs think_token_ids=(open, close) or a tokenizer")
        think_token_ids = think_ids(tokenizer)
    seqs = stop_sequences(tokenizer, stop_strings)
    params = SamplingParams.create(B, temperature=temperature, top_k=top_k, top_p=top_p,
                                   stop_token_ids=stop_token_ids, stop_sequences=seqs,
                                   think_ids=think_token_ids or (NO_TOKEN, NO_TOKEN))
    P = bucket(max(len(p) for p in prompts), 64)
    need = P + max(max_new) + 1
    max_len = bucket(need, 128) if max_len is None else int(max_len)
    longest = max(len(p) for p in prompts)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    over = [b for b, p in enumerate(prompts) if max_pos and len(p) + max_new[b] > max_pos]
    if over:
        b = over[0]
        raise ValueError(f"prompt {b} ({len(prompts[b])} tokens) + max_new_tokens="
                         f"{max_new[b]} exceeds the model's max_position_embeddings="
                         f"{max_pos}; expected at most {max_pos} positions")
    if longest + 1 > max_len:
        raise ValueError(f"the longest prompt has {longest} tokens; it does not fit a cache "
                         f"of max_len={max_len} (need max_len >= prompt length + 1)")
    P = min(P, max_len - 1)
    prompt_BxP = np.zeros((B, P), np.int32)
    for b, p in enumerate(prompts):
        prompt_BxP[b, P - len(p):] = p
    lens_B = np.array([len(p) for p in prompts], np.int32)
    budget_B = np.array([NO_BUDGET if b is None else b for b in budgets], np.int32)
    common = dict(seed=seed, max_new_B=np.array(max_new, np.int32), max_len=max_len,
                  think_budget_B=budget_B, row_ids_B=row_ids)
    if mesh is not None:
        common["mesh"] = mesh
    if steps_per_call:
        batch, state = sample(model, prompt_BxP, lens_B, params, max_steps=steps_per_call,
                              **common)
        while bool(jnp.any(state.active_B)):
            batch, state = resume(model, state, params, steps_per_call)
    else:
        batch, _ = sample(model, prompt_BxP, lens_B, params, **common)
    return to_result(batch)


def to_result(batch: engine.RolloutBatch) -> GenerateResult:
    """Host lists of the sampled tokens (after each row's prompt) from a packed batch."""
    # fetch, not device_get: with mesh= across processes the rows live on several hosts.
    tokens, logp, forced, lens, plens, fin = fetch((
        batch.tokens_BxL, batch.sampler_logp_BxL,
        batch.forced_mask_BxL, batch.lengths_B, batch.prompt_lens_B, batch.finish_reason_B))
    out_t, out_l = [], []
    for b in range(tokens.shape[0]):
        first = int(plens[b])
        if forced[b, :lens[b]].any():
            first = min(first, int(np.argmax(forced[b])))
        out_t.append(tokens[b, first:lens[b]].tolist())
        out_l.append(logp[b, first:lens[b]].tolist())
    return GenerateResult(out_t, out_l, [FINISH_NAMES[int(f)] for f in fin], batch)
