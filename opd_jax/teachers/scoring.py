"""Teacher scoring for OPD: each teacher runs once per iteration on the episodes routed to it.

    scorer = TeacherScorer(bank, tokenizer, kind="logp", role="student", chunk_rows=8)
    scored = scorer(episodes, weights, student_seqs)        # {key: (rows, values, W)}
    scores = teacher_fields(scored, weights, kind="logp")   # TeacherScores

`kind` is what the objective declares it needs (`objectives.Needs.teacher`): "logp", the
teacher's log-probs of the student's sampled tokens [B, T]; "hidden", its last-layer
hidden states [B, T, E] plus its unembedding (the full-vocabulary objective); or "topk",
its `top_k` most likely tokens per position and their log-probs at `temperature`
([B, T, K] ids and log-probs: the signal a served teacher can send).

On a mesh (the bank's, `TeacherBank(mesh=)`), the teacher forward is jitted with the
teacher's parameters as the bank placed them, the rows sharded like the student's batch
(`sharding.shard_batch`) and the outputs batch-sharded: the rows routed to a teacher are
padded (repeating the first) to a multiple of a chunk that divides over the batch mesh
axes. Values stay global arrays (aligned to the student's rows inside one jitted gather), so
a mesh spanning several processes never reads a non-addressable array on the host.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax import envs, losses
from opd_jax import sharding as sh
from opd_jax.distributed import settle
from opd_jax.episodes import align_to_student, build_sequences, prompt_ids
from opd_jax.episodes.sequences import ROW_MULTIPLE
from opd_jax.shapes import bucket
from opd_jax.teachers.bank import TeacherBank
from opd_jax.teachers.cross_tokenizer import (cut_response, gather_values, map_response,
                                              map_topk, one_to_one, vocab_map)
from opd_jax.teachers.routing import confidence_weights
from opd_jax.teachers.served import ServedTeacher

# What a scoring forward reads from a sequence batch.
MODEL_INPUTS = ("inputs", "targets", "segment_ids")
KINDS = ("logp", "hidden", "topk")


def teacher_outputs(params, rest, batch: dict, *, graphdef, kind: str = "logp",
                    top_k: int = 0, temperature: float = 1.0, entropy: bool = False):
    """A teacher's view of its own batch: target log-probs [B, T], hidden [B, T, E] (with
    `entropy`: (hidden, the entropy of softmax(logits / temperature) [B, T])), or (top-k ids
    [B, T, K] int32, their log-probs at `temperature` [B, T, K])."""
    model = nnx.merge(graphdef, params, rest)
    if kind == "hidden":
        h = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"], return_hidden=True)
        if not entropy:
            return h
        return h, losses.token_entropy(model.logits(h), temperature)
    logits_BxTxV = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
    if kind == "topk":
        return losses.teacher_topk(logits_BxTxV, top_k, temperature)
    return losses.token_logprobs(logits_BxTxV, batch["targets"])


def in_row_chunks(fn, batch: dict, rows: int, take=None):
    """``fn`` on consecutive `rows`-row slices of `batch`, outputs concatenated along rows.
    `take(batch, idx)`: how a slice is cut (default: indexing; a run on a mesh passes
    `Layout.take_rows`, which gathers it on device in the batch sharding).

    The no-grad scoring passes (old / reference log-probs, teachers) run one training
    minibatch of rows at a time, so their [rows, T, V] logits never exceed what the train
    step itself holds. Slices keep the global row order (as the minibatch split does).
    """
    B = jax.tree.leaves(batch)[0].shape[0]
    if rows <= 0 or B % rows:
        raise ValueError(f"scoring chunk of {rows} rows for a batch of {B}: expected a "
                         f"positive divisor of {B}")
    if take is None:
        outs = [fn(jax.tree.map(lambda x: x[i:i + rows], batch)) for i in range(0, B, rows)]
    else:
        outs = [fn(take(batch, np.arange(i, i + rows))) for i in range(0, B, rows)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs) if len(outs) > 1 else outs[0]


class TeacherScorer:
    """Scores episodes with their teachers: each teacher runs once per iteration on the rows
    routed to it, in chunks of `chunk_rows` (the last chunk padded by repeating a row).

    Shapes stay few, so a run compiles its teacher forwards early and then not again: fewer
    routed rows than `chunk_rows` make one chunk of the next power of two (1, 2, 4, ...),
    not one of their own count, and a teacher's rows are at least as long as the student's
    (which grow only: `phases.Batcher`), not bucketed on their own.

    With the bank on a mesh (`bank.mesh`), chunks are rounded up to a multiple of the
    batch shards (`sharding.batch_shards`) and the forward runs sharded (module docstring).
    """

    def __init__(self, bank: TeacherBank, tokenizer, kind: str, role: str = "student",
                 chunk_rows: int = 0, top_k: int = 0, temperature: float = 1.0,
                 entropy: bool = False, served: dict | None = None,
                 tokenizers: dict | None = None):
        if kind not in KINDS:
            raise ValueError(f"teacher scoring kind {kind!r}: expected one of {KINDS}")
        if (kind == "topk") != (top_k > 0):
            raise ValueError(f"teacher scoring kind {kind!r} with top_k={top_k}: the top-k "
                             f"signal needs top_k >= 1, the others top_k=0")
        if not temperature > 0:
            raise ValueError(f"teacher scoring temperature={temperature}: expected > 0")
        if entropy and kind != "hidden":
            raise ValueError(f"teacher entropies (confidence weighting) come with the "
                             f"hidden-state signal; got kind {kind!r}")
        self.entropy = bool(entropy)
        # Served teachers (`bank.is_served`): their client options (`teachers.served`), the
        # clients once probed, and per call the [B, T] mask of response tokens they left
        # without what the signal reads (`invalid`: 1 there; teacher_fields -> teacher_valid).
        self.served_opts, self._served, self.invalid = dict(served or {}), {}, {}
        # Teachers with their own tokenizer {key: tokenizer} (`cross_tokenizer`): the
        # sampled-token and top-k signals (not hidden states).
        self.tokenizers = dict(tokenizers or {})
        self.cross_stats = {"exact": 0, "tokens": 0}   # the last call's, over those teachers
        if self.tokenizers and kind == "hidden":
            raise ValueError(f"teachers {sorted(self.tokenizers)} have another tokenizer than "
                             f"the student: supported for the sampled-token and top-k "
                             f"signals, not the full vocabulary (hidden states)")
        self._vmaps = {}
        self.bank, self.tokenizer, self.kind, self.role = bank, tokenizer, kind, role
        self.top_k, self.temperature = int(top_k), float(temperature)
        self.chunk_rows = chunk_rows
        self.mesh, self.rules = getattr(bank, "mesh", None), getattr(bank, "rules",
                                                                     sh.DEFAULT_RULES)
        self.shards = 1 if self.mesh is None else sh.batch_shards(self.mesh, self.rules)
        self._fns, self._gathers = {}, {}

    def _fn(self, graphdef, params, rest):
        """The jitted teacher forward of `graphdef` (one per graphdef: teachers of one shape
        share it and their placement)."""
        if graphdef not in self._fns:
            fn = functools.partial(teacher_outputs, graphdef=graphdef, kind=self.kind,
                                   top_k=self.top_k, temperature=self.temperature,
                                   entropy=self.entropy)
            if self.mesh is None:
                self._fns[graphdef] = jax.jit(fn)
            else:
                placed = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
                batch_s = sh.batch_sharding(self.mesh, 2, self.rules)
                b2, b3 = (sh.batch_sharding(self.mesh, n, self.rules) for n in (2, 3))
                out_s = {"logp": b2, "hidden": (b3, b2) if self.entropy else b3,
                         "topk": (b3, b3)}[self.kind]
                self._fns[graphdef] = jax.jit(
                    fn, in_shardings=(placed(params), placed(rest), batch_s),
                    out_shardings=out_s)
        return self._fns[graphdef]

    def _gather(self, ndim: int, B: int, T: int):
        """jit: chunk outputs -> [B, T(, E)] values at the student's targets: routed row r
        goes to row dest[r] (padding rows have dest B and are dropped), other rows 0."""
        key = (ndim, B, T)
        if key not in self._gathers:
            def gather(chunks, t_plen_R, s_plen_R, dest_R):
                vals = jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]
                aligned = align_to_student(vals, t_plen_R, s_plen_R, T)
                full = jnp.zeros((B,) + aligned.shape[1:], aligned.dtype)
                return full.at[dest_R].set(aligned, mode="drop")
            self._gathers[key] = jax.jit(gather, out_shardings=None if self.mesh is None else
                                         sh.batch_sharding(self.mesh, ndim, self.rules))
        return self._gathers[key]

    def served(self, key: str) -> ServedTeacher:
        """The client of served teacher `key`, built and probed on first use."""
        if key not in self._served:
            spec = self.bank.spec(key)
            if self.kind == "hidden":
                raise ValueError(f"teacher {key!r} is served by {spec}: a server sends "
                                 f"log-probs, not hidden states; use a sampled-token "
                                 f"objective (kimi_mopd, glm_cross_stage) or topk_distill")
            opts = {k: v for k, v in self.served_opts.items() if k != "params"}
            client = ServedTeacher(spec, self.tokenizer, top_k=self.top_k,
                                   temperature=self.temperature, **opts)
            client.probe()
            self._served[key] = client
        return self._served[key]

    def _served_values(self, key: str, prompts, responses, tseq) -> tuple:
        """A served teacher's values in the layout of `tseq` (its targets): the sampled
        token's log-prob [R, Tt] or the top-k (ids, log-probs) [R, Tt, K], then a [R, Tt]
        float mask, 1 on response targets the server gave no log-prob for."""
        rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
        scores = self.served(key).score(rows, starts=[len(p) for p in prompts])
        R, Tt = tseq["targets"].shape
        invalid = np.zeros((R, Tt), np.float32)
        lp = np.zeros((R, Tt), np.float32)
        K = max(self.top_k, 1)
        ids, tlp = np.full((R, Tt, K), -1, np.int32), np.full((R, Tt, K), -np.inf, np.float32)
        for r, (ps, p, resp) in enumerate(zip(scores, prompts, responses)):
            n = len(p) + len(resp) - 1            # targets i <-> positions i + 1
            if self.kind == "topk":
                # the loss reads the top-k entries only: a response target is missing when
                # it has none (a sampled token outside them, whose own log-prob a top-only
                # server leaves NaN, is still scored by the distribution)
                ids[r, :n], tlp[r, :n] = ps.top_ids[1:n + 1, :K], ps.top_lp[1:n + 1, :K]
                invalid[r, len(p) - 1:n] = (ids[r, len(p) - 1:n] < 0).all(-1)
            else:
                vals = ps.lp[1:n + 1]
                miss = np.isnan(vals)
                lp[r, :n] = np.where(miss, 0.0, vals)
                invalid[r, len(p) - 1:n] = miss[len(p) - 1:n]
        return ((ids, tlp) if self.kind == "topk" else (lp,)), invalid

    def _chunk(self, n_rows: int) -> int:
        """Rows per scoring forward: `chunk_rows`, or the next power of two of `n_rows` when
        that is smaller (all rows when `chunk_rows` is 0), rounded up to a multiple of the
        batch shards."""
        chunk = bucket(n_rows, n_rows)                   # the next power of two
        if self.chunk_rows:
            chunk = min(chunk, self.chunk_rows)
        return -(-chunk // self.shards) * self.shards

    def __call__(self, episodes, weights, student_seqs):
        """Per teacher key: (rows with weight > 0, values aligned to student targets for all
        B rows, zeros on the rows it does not score, W_t). On a mesh the values are
        batch-sharded global arrays and W_t keeps the bank's placement."""
        B, T = student_seqs["targets"].shape
        if B % self.shards:
            raise ValueError(f"teacher scoring of {B} student rows on mesh "
                             f"{dict(self.mesh.shape)}: expected a multiple of its "
                             f"{self.shards} batch shards")
        out, self.invalid = {}, {}
        self.cross_stats = {"exact": 0, "tokens": 0}
        # Teachers already in the cache first: with a cache smaller than the bank, a fixed
        # order would evict each teacher just before it is needed again (every access a miss).
        loaded = set(self.bank.loaded())
        for key in sorted({k for w in weights for k in w}, key=lambda k: (k not in loaded, k)):
            rows = [b for b, w in enumerate(weights) if w.get(key, 0.0) > 0]
            if self.bank.is_served(key):
                out[key] = self._score_served(key, episodes, rows, student_seqs, B, T)
                continue
            if key in self.tokenizers:
                out[key] = self._score_cross(key, episodes, rows, student_seqs, B, T)
                continue
            teacher = self.bank.get(key)
            graphdef, params, rest = nnx.split(teacher, nnx.Param, ...)
            chunk = self._chunk(len(rows))
            padded = rows + rows[:1] * (-len(rows) % chunk)
            prompts = [prompt_ids(self.tokenizer, envs.render_prompt(episodes[b].task,
                                                                      role=self.role))
                       for b in padded]
            responses = [episodes[b].response_ids for b in padded]
            # At least the student's row length (one compile per teacher shape and length).
            tseq = build_sequences(prompts, responses, seq_len=max(T, bucket(
                max(len(p) + len(r) for p, r in zip(prompts, responses)) - 1, ROW_MULTIPLE)))
            fn = self._fn(graphdef, params, rest)
            inputs = {k: tseq[k] for k in MODEL_INPUTS}
            chunks = [settle(fn(params, rest, self._place(jax.tree.map(
                lambda x: x[i:i + chunk], inputs)))) for i in range(0, len(padded), chunk)]
            dest = np.asarray(rows + [B] * (len(padded) - len(rows)), np.int32)
            host = (np.asarray(tseq["prompt_len"], np.int32),
                    np.asarray(student_seqs["prompt_len"], np.int32)[padded], dest)
            if self.mesh is not None:   # the same host values on every process
                host = tuple(sh.put(x, sh.replicated(self.mesh)) for x in host)
            # Each output (the top-k signal has two: ids and log-probs) aligned on its own.
            parts = [c if isinstance(c, tuple) else (c,) for c in chunks]
            full = tuple(settle(self._gather(cs[0].ndim, B, T)(tuple(cs), *host))
                         for cs in zip(*parts))
            out[key] = (rows, full if len(full) > 1 else full[0],
                        settle(teacher.unembedding()) if self.kind == "hidden" else None)
        return out

    def _score_served(self, key, episodes, rows, student_seqs, B, T):
        prompts = [prompt_ids(self.tokenizer, envs.render_prompt(episodes[b].task,
                                                                  role=self.role))
                   for b in rows]
        responses = [episodes[b].response_ids for b in rows]
        tseq = build_sequences(prompts, responses)
        values, invalid = self._served_values(key, prompts, responses, tseq)
        return self._host_values(key, rows, values, invalid, B, T,
                                 np.asarray(tseq["prompt_len"], np.int32),
                                 np.asarray(student_seqs["prompt_len"], np.int32)[rows])

    def _host_values(self, key, rows, values, invalid, B, T, t_plen, s_plen):
        """Host-computed teacher values (a served or cross-tokenizer teacher: [R, Tt(, K)]
        in a layout whose prompts are `t_plen` long) aligned to the student's B rows like
        the in-process ones, and their `invalid` mask kept for `teacher_fields`; on a mesh
        replicated (every process computes the same values)."""
        host = (t_plen, s_plen, np.asarray(rows, np.int32))
        if self.mesh is not None:
            host = tuple(sh.put(x, sh.replicated(self.mesh)) for x in host)
            values = tuple(sh.put(v, sh.replicated(self.mesh)) for v in values)
            invalid = sh.put(invalid, sh.replicated(self.mesh))
        full = tuple(settle(self._gather(v.ndim, B, T)((v,), *host)) for v in values)
        self.invalid[key] = settle(self._gather(2, B, T)((invalid,), *host))
        return rows, full if len(full) > 1 else full[0], None

    def _score_cross(self, key, episodes, rows, student_seqs, B, T):
        """A teacher with its own tokenizer: each row's prompt rendered and its response
        carried into the teacher's tokens (`cross_tokenizer.map_response`), scored, and the
        teacher's log-probs gathered back onto the student's response tokens; tokens it
        gives no value are masked (`invalid`)."""
        ttok = self.tokenizers[key]
        t_prompts, t_resps, assigns, exacts = [], [], [], []
        exact = total = 0
        for b in rows:
            ep = episodes[b]
            ids_t, assign, ex = map_response(self.tokenizer, ttok, ep.response_ids)
            t_prompts.append(prompt_ids(ttok, envs.render_prompt(ep.task, role=self.role)))
            t_resps.append(ids_t)
            assigns.append(assign)
            exacts.append(ex)
            exact, total = exact + int(ex.sum()), total + len(ex)
        self.cross_stats = {"exact": self.cross_stats["exact"] + exact,
                            "tokens": self.cross_stats["tokens"] + total}
        teacher = self.bank.get(key)
        # A row longer than the teacher's context is cut there (`cut_response`).
        room = teacher.config.max_position_embeddings
        for r in range(len(rows)):
            keep = max(room - len(t_prompts[r]), 0)
            t_resps[r], assigns[r] = cut_response(t_resps[r], assigns[r], keep)
        graphdef, params, rest = nnx.split(teacher, nnx.Param, ...)
        # as the plain path: `chunk_rows` rows per forward, padded to the batch shards
        chunk = self._chunk(len(rows))
        pad = -len(rows) % chunk
        tseq = build_sequences(t_prompts + t_prompts[:1] * pad, t_resps + t_resps[:1] * pad,
                               seq_len=bucket(max(len(p) + len(r) for p, r
                                                  in zip(t_prompts, t_resps)) - 1, 16))
        fn = self._fn(graphdef, params, rest)
        inputs = {k: tseq[k] for k in MODEL_INPUTS}
        parts = [fn(params, rest, self._place(jax.tree.map(lambda x: x[i:i + chunk], inputs)))
                 for i in range(0, len(rows) + pad, chunk)]
        parts = [p if isinstance(p, tuple) else (p,) for p in parts]
        out = tuple(np.concatenate([to_host(p[j]) for p in parts])[:len(rows)]
                    for j in range(len(parts[0])))
        out = out if len(out) > 1 else out[0]
        s_plen = np.asarray(student_seqs["prompt_len"], np.int32)[rows]
        invalid = np.zeros((len(rows), T), np.float32)
        if self.kind == "topk":
            if key not in self._vmaps:
                self._vmaps[key] = vocab_map(ttok, self.tokenizer, teacher.config.vocab_size)
            vmap, (tid, tlp) = self._vmaps[key], out
            K = tid.shape[-1]
            ids = np.full((len(rows), T, K), -1, np.int32)
            lps = np.full((len(rows), T, K), -np.inf, np.float32)
        else:
            lp_t = out
            vals = np.zeros((len(rows), T), np.float32)
        for r, b in enumerate(rows):
            P_t, P_s, n = len(t_prompts[r]), int(s_plen[r]), len(episodes[b].response_ids)
            if self.kind == "topk":
                # the teacher's next-token distribution is over the student's next token
                # only where one teacher token is exactly it (`one_to_one`)
                u_of = one_to_one(assigns[r], exacts[r])
                for t in range(n):
                    if u_of[t] >= 0:
                        i = P_t - 1 + int(u_of[t])
                        ids[r, P_s - 1 + t], lps[r, P_s - 1 + t] = map_topk(tid[r, i], tlp[r, i],
                                                                            vmap)
                miss = (u_of < 0) | (ids[r, P_s - 1:P_s - 1 + n] < 0).all(-1)
            else:
                v = gather_values(assigns[r], lp_t[r, P_t - 1:P_t - 1 + len(t_resps[r])], n)
                miss = np.isnan(v)
                vals[r, P_s - 1:P_s - 1 + n] = np.where(miss, 0.0, v)
            invalid[r, P_s - 1:P_s - 1 + n] = miss
        values = (ids, lps) if self.kind == "topk" else (vals,)
        # already in the student's layout: its own prompt lengths on both sides
        return self._host_values(key, rows, values, invalid, B, T, s_plen, s_plen)

    def _place(self, batch: dict) -> dict:
        return batch if self.mesh is None else sh.shard_batch(batch, self.mesh, self.rules)


def to_host(x) -> np.ndarray:
    """A (possibly batch-sharded, multi-process) array's whole value on this host."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@dataclasses.dataclass
class TeacherScores:
    """One iteration's teacher signal, as the objective reads it: `order` (slot s is the
    teacher `order[s]`, sorted keys), the batch `fields` and, for the hidden-state signal,
    the teachers' `unembeddings` [E_s, V] (the train step's `teachers` argument)."""
    order: list[str]
    fields: dict
    unembeddings: tuple = ()


def teacher_fields(scored: dict, weights: list[dict], kind: str,
                   slots: list[str] | None = None, absent: dict | None = None,
                   confidence: float | None = None) -> TeacherScores:
    """The `TeacherScores` of a `TeacherScorer` result.

    Slot s is the s-th of `slots` (every teacher the run's routing uses, so the shapes, and
    the compiled step, do not change with the iteration's mix of teachers), or of the
    scored keys in sorted order when `slots` is None. A slot whose teacher scored no row
    of this iteration gets zeros: `absent` gives, for the hidden-state signal, its
    ``(hidden zeros [B, T, E_s], unembedding [E_s, V])``.
    kind "logp":   teacher_logp [B, T] (each row from its one teacher), teacher_onehot [B, S].
    kind "topk":   teacher_topk_ids [B, T, K] int32 and teacher_topk_logp [B, T, K] (each
                   row from its one teacher; rows no teacher scores hold id 0 and log-prob
                   0, masked out by the loss), teacher_onehot [B, S].
    kind "hidden": teacher_hidden (S arrays [B, T, E_s], zeros on rows a teacher does not
                   score, masked out in the loss), teacher_weights [B, S] (= teacher_onehot),
                   and the S unembeddings [E_s, V] as the third value. With `confidence`
                   (a temperature; the scorer then returns (hidden, entropy [B, T]) per
                   teacher), teacher_weights is per token [B, T, S]:
                   `routing.confidence_weights(teacher_onehot, entropies, confidence)`.
    """
    order = sorted(scored) if slots is None else list(slots)
    missing = sorted(set(scored) - set(order))
    if missing:
        raise ValueError(f"teachers {missing} scored rows but are not among the slots {order}")
    onehot = np.asarray([[w.get(k, 0.0) for k in order] for w in weights],
                        np.float32)     # [B, S]: one-hot unless routing=mixture
    fields = {"teacher_onehot": onehot}
    if kind == "topk":
        if not scored:
            raise ValueError("top-k teacher signal: no teacher scored any row")
        routed_SxB = _routed(order, scored, len(weights))
        first = next(iter(scored.values()))[1]
        for i, name in enumerate(("teacher_topk_ids", "teacher_topk_logp")):
            vals = tuple(scored[k][1][i] if k in scored else zeros_like(first[i], first[i].shape)
                         for k in order)
            fields[name] = settle(_rows_from_teachers(vals, _like(routed_SxB, vals[0])))
        return TeacherScores(order, fields)
    if kind == "logp":
        if not scored:
            fields["teacher_logp"] = np.zeros((len(weights), 0), np.float32)
            return TeacherScores(order, fields)
        routed_SxB = _routed(order, scored, len(weights))
        first = next(iter(scored.values()))[1]
        vals = tuple(scored[k][1] if k in scored else zeros_like(first, first.shape)
                     for k in order)
        fields["teacher_logp"] = settle(_rows_from_teachers(vals, _like(routed_SxB, vals[0])))
        return TeacherScores(order, fields)
    absent = absent or {}
    if confidence is None:
        fields["teacher_hidden"] = tuple(scored[k][1] if k in scored else absent[k][0]
                                         for k in order)
        fields["teacher_weights"] = onehot
    else:
        fields["teacher_hidden"] = tuple(scored[k][1][0] if k in scored else absent[k][0]
                                         for k in order)
        ent = tuple(scored[k][1][1] if k in scored else
                    zeros_like(fields["teacher_hidden"][0], onehot.shape[:1] +
                               fields["teacher_hidden"][0].shape[1:2]) for k in order)
        fields["teacher_weights"] = settle(_confidence(
            _like(onehot, ent[0]), jnp.stack(ent), float(confidence)))
    return TeacherScores(order, fields, tuple(scored[k][2] if k in scored else absent[k][1]
                                              for k in order))


def zeros_like(x, shape) -> jax.Array:
    """Zeros of `shape` in `x`'s dtype and sharding (placed, not computed: no compile)."""
    zeros = np.zeros(shape, np.dtype(x.dtype))
    s = getattr(x, "sharding", None)
    return sh.put(zeros, s) if isinstance(s, jax.sharding.NamedSharding) else \
        jnp.asarray(zeros)


@functools.partial(jax.jit, static_argnums=2)
def _confidence(prior_BxS, entropy_SxBxT, temperature):
    return confidence_weights(prior_BxS, entropy_SxBxT, temperature)


def _routed(order: list[str], scored: dict, B: int) -> np.ndarray:
    """[S, B] bool: slot s scored row b."""
    routed_SxB = np.zeros((len(order), B), bool)
    for s, key in enumerate(order):
        if key in scored:
            routed_SxB[s, scored[key][0]] = True
    return routed_SxB


@jax.jit
def _rows_from_teachers(vals, routed_SxB):
    """[B, T, ...] (fp32, or the values' integer dtype): each row from the teacher slot
    routed to it (the last if several), 0 on rows no teacher scores."""
    dtype = vals[0].dtype if jnp.issubdtype(vals[0].dtype, jnp.integer) else jnp.float32
    out = jnp.zeros(vals[0].shape, dtype)
    for s, v in enumerate(vals):
        pick = routed_SxB[s].reshape((-1,) + (1,) * (v.ndim - 1))
        out = jnp.where(pick, v.astype(dtype), out)
    return out


def _like(host: np.ndarray, x):
    """`host` (the same on every process) replicated on the mesh `x` lives on, if any."""
    s = getattr(x, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        return sh.put(host, sh.replicated(s.mesh))
    return host
