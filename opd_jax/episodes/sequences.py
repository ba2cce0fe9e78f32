"""Host-side batch building for RL and OPD: prompt + response rows, shifted and padded.

Legend: B rows, T target positions (row length - 1), P prompt length.

A row is ``prompt + response`` right-padded to ``T + 1`` tokens. Like SFT batches, a
sequence batch holds ``inputs_BxT = row[:-1]`` and ``targets_BxT = row[1:]``; response
token j of row b is target ``P_b - 1 + j``. ``mask_BxT`` is 1 on response targets the loss
may use (the rollout's response mask: environment observation tokens are 0), and per-token
arrays given for the response (sampler log-probs) are scattered to the same positions.

The teacher scores the *same* response after its own prompt (Kimi's teachers see the plain
prompt; the student sees the effort token). :func:`align_to_student` maps any per-target
teacher array back to the student's positions.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from opd_jax.shapes import bucket

# Rows are padded to bucket(longest - 1, ROW_MULTIPLE) tokens unless a length is given.
ROW_MULTIPLE = 16


def build_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                    response_masks: Sequence[Sequence[int]] | None = None,
                    sampler_logps: Sequence[Sequence[float]] | None = None,
                    seq_len: int | None = None, multiple: int = ROW_MULTIPLE) -> dict[str, np.ndarray]:
    """Pad ``prompt + response`` rows into a shifted batch (see module docstring).

    Returns int32 ``inputs, targets, mask, segment_ids, positions`` [B, T], float32
    ``sampler_logp`` [B, T] (0 where unknown), and int32 ``prompt_len, response_len`` [B].
    `seq_len` fixes T (rows that do not fit are an error); otherwise T is the longest row
    minus one, bucketed by `shapes.bucket(n, multiple)`.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    for b, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"row {b}: empty prompt")
    T = bucket(max(lengths) - 1, multiple) if seq_len is None else seq_len
    if max(lengths) - 1 > T:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit seq_len {T} (+1)")
    B = len(prompts)
    rows = np.zeros((B, T + 1), np.int32)
    mask = np.zeros((B, T), np.int32)
    logp = np.zeros((B, T), np.float32)
    seg = np.zeros((B, T), np.int32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        P, R = len(p), len(r)
        rows[b, :P] = p
        rows[b, P:P + R] = r
        seg[b, :min(P + R, T)] = 1
        m = np.ones(R, np.int32) if response_masks is None else np.asarray(response_masks[b])
        if len(m) != R:
            raise ValueError(f"row {b}: response mask of length {len(m)} for {R} tokens")
        mask[b, P - 1:P - 1 + R] = m
        if sampler_logps is not None:
            lp = np.asarray(sampler_logps[b], np.float32)
            if len(lp) != R:
                raise ValueError(f"row {b}: {len(lp)} sampler log-probs for {R} tokens")
            logp[b, P - 1:P - 1 + R] = lp
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    return {
        "inputs": rows[:, :-1], "targets": rows[:, 1:], "mask": mask, "segment_ids": seg,
        "positions": positions, "sampler_logp": logp,
        "prompt_len": np.asarray([len(p) for p in prompts], np.int32),
        "response_len": np.asarray([len(r) for r in responses], np.int32),
    }


def align_to_student(values_BxTt, teacher_prompt_len_B, student_prompt_len_B, T: int):
    """Gather per-target teacher values (``[B, Tt]`` or ``[B, Tt, E]``) to student targets.

    Student target i holds response token ``j = i - (P_s - 1)``, which the teacher holds at
    ``P_t - 1 + j``. Positions outside the teacher row read its last entry; they are masked.
    """
    Tt = values_BxTt.shape[1]
    i_T = jnp.arange(T, dtype=jnp.int32)
    idx_BxT = i_T[None, :] - student_prompt_len_B[:, None] + teacher_prompt_len_B[:, None]
    idx_BxT = jnp.clip(idx_BxT, 0, Tt - 1)
    if values_BxTt.ndim == 3:
        return jnp.take_along_axis(values_BxTt, idx_BxT[:, :, None], axis=1)
    return jnp.take_along_axis(values_BxTt, idx_BxT, axis=1)
