"""Teacher scoring for OPD: each teacher runs once per iteration on the episodes routed to it.

    scorer = TeacherScorer(bank, tokenizer, kind="logp", role="student", chunk_rows=8)
    scored = scorer(episodes, weights, student_seqs)        # {key: (rows, values, W)}
    fields, unembeddings = teacher_fields(scored, weights, kind="logp")

`kind` is what the objective declares it needs (`objectives.Needs.teacher`): "logp", the
teacher's log-probs of the student's sampled tokens [B, T], or "hidden", its last-layer
hidden states [B, T, E] plus its unembedding (the full-vocabulary objective).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax import envs
from opd_jax.teachers.bank import TeacherBank
from opd_jax.trainers.episodes import encode
from opd_jax.trainers.policy import teacher_outputs
from opd_jax.trainers.sequences import align_to_student, bucket, build_sequences

# What a scoring forward reads from a sequence batch.
MODEL_INPUTS = ("inputs", "targets", "segment_ids")
KINDS = ("logp", "hidden")


def in_row_chunks(fn, batch: dict, rows: int):
    """``fn`` on consecutive `rows`-row slices of `batch`, outputs concatenated along rows.

    The no-grad scoring passes (old / reference log-probs, teachers) run one training
    minibatch of rows at a time, so their [rows, T, V] logits never exceed what the train
    step itself holds. Slices keep the global row order (as the minibatch split does).
    """
    B = jax.tree.leaves(batch)[0].shape[0]
    if rows <= 0 or B % rows:
        raise ValueError(f"scoring chunk of {rows} rows for a batch of {B}: expected a "
                         f"positive divisor of {B}")
    outs = [fn(jax.tree.map(lambda x: x[i:i + rows], batch)) for i in range(0, B, rows)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs) if len(outs) > 1 else outs[0]


class TeacherScorer:
    """Scores episodes with their teachers: each teacher runs once per iteration on the rows
    routed to it, in chunks of `chunk_rows` (the last chunk padded by repeating a row)."""

    def __init__(self, bank: TeacherBank, tokenizer, kind: str, role: str = "student",
                 chunk_rows: int = 0):
        if kind not in KINDS:
            raise ValueError(f"teacher scoring kind {kind!r}: expected one of {KINDS}")
        self.bank, self.tokenizer, self.kind, self.role = bank, tokenizer, kind, role
        self.chunk_rows = chunk_rows
        self._fns = {}

    def _fn(self, graphdef):
        if graphdef not in self._fns:
            self._fns[graphdef] = jax.jit(functools.partial(teacher_outputs, graphdef=graphdef,
                                                            kind=self.kind))
        return self._fns[graphdef]

    def __call__(self, episodes, weights, student_seqs):
        """Per teacher key: (rows with weight > 0, values aligned to student targets for all
        B rows, zeros on the rows it does not score, W_t)."""
        B, T = student_seqs["targets"].shape
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        out = {}
        # Teachers already in the cache first: with a cache smaller than the bank, a fixed
        # order would evict each teacher just before it is needed again (every access a miss).
        loaded = set(self.bank.loaded())
        for key in sorted({k for w in weights for k in w}, key=lambda k: (k not in loaded, k)):
            rows = [b for b, w in enumerate(weights) if w.get(key, 0.0) > 0]
            teacher = self.bank.get(key)
            graphdef, params, rest = nnx.split(teacher, nnx.Param, ...)
            chunk = min(self.chunk_rows or len(rows), len(rows))
            padded = rows + rows[:1] * (-len(rows) % chunk)
            prompts = [bos + encode(self.tokenizer, envs.render_prompt(episodes[b].task,
                                                                        role=self.role))
                       for b in padded]
            responses = [episodes[b].response_ids for b in padded]
            # Row length bucketed (one compile per teacher shape and bucket).
            tseq = build_sequences(prompts, responses, seq_len=bucket(
                max(len(p) + len(r) for p, r in zip(prompts, responses)) - 1))
            vals = in_row_chunks(lambda sub: self._fn(graphdef)(params, rest, sub),
                                 {k: tseq[k] for k in MODEL_INPUTS}, chunk)
            aligned = align_to_student(vals, jnp.asarray(tseq["prompt_len"]),
                                       jnp.asarray(student_seqs["prompt_len"][padded]), T)
            full = jnp.zeros((B,) + aligned.shape[1:], aligned.dtype)
            full = full.at[np.asarray(rows)].set(aligned[:len(rows)])
            out[key] = (rows, full, teacher.unembedding() if self.kind == "hidden" else None)
        return out


def teacher_fields(scored: dict, weights: list[dict], kind: str) -> tuple[list, dict, tuple]:
    """(slot order, batch fields, teacher unembeddings) from a `TeacherScorer` result.

    Slot s is the s-th teacher key in sorted order (stable within an iteration).
    kind "logp":   teacher_logp [B, T] (each row from its one teacher), teacher_onehot [B, S].
    kind "hidden": teacher_hidden (S arrays [B, T, E_s], zeros on rows a teacher does not
                   score, masked out in the loss), teacher_weights [B, S] (= teacher_onehot),
                   and the S unembeddings [E_s, V] as the third value.
    """
    order = sorted(scored)
    onehot = np.asarray([[w.get(k, 0.0) for k in order] for w in weights],
                        np.float32)     # [B, S]: one-hot unless routing=mixture
    fields = {"teacher_onehot": onehot}
    if kind == "logp":
        first = next(iter(scored.values()))[1] if scored else None
        tl = np.zeros(first.shape if first is not None else (len(weights), 0), np.float32)
        for key in order:
            rows, vals, _ = scored[key]
            tl[rows] = np.asarray(vals)[rows]
        fields["teacher_logp"] = tl
        return order, fields, ()
    fields["teacher_hidden"] = tuple(scored[k][1] for k in order)
    fields["teacher_weights"] = onehot
    return order, fields, tuple(scored[k][2] for k in order)
