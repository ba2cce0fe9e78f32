"""Token write-ahead log: resume a killed rollout job from its last logged token.

One append-only file per job. A record is framed as

    u32 length | u32 crc32(payload) | payload         (little endian)

and the payload's first byte is its kind: HEADER (JSON: the job's identity), TOKEN (row,
position, token, logp), FINISH (row, reason), TURN (row, turn: a multi-turn episode's
environment stepped on that turn; written by `opd_jax.trainers.episodes.play`) or COMMIT
(chunk number). `generate_logged`
decodes `steps_per_call` steps at a time; after each chunk it appends the chunk's tokens,
the rows that finished, and a COMMIT, then fsyncs once. Durability window: one chunk (at
most `steps_per_call` tokens per row are lost by a kill; they are regenerated, identically).

Replay reads records in order and applies them at each COMMIT; a torn or corrupt record
(short read, bad length, bad CRC) ends the log, so an uncommitted tail is dropped and the
file is truncated there before appending. A resumed job re-prefills prompt + logged
tokens (teacher-forced), then samples on: every draw comes from the (seed, row, position)
stream, so the result equals an uninterrupted run, and rows are continued, never restarted
(restarting the unfinished ones would bias the batch toward short responses).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from opd_jax.rollout import engine
from opd_jax.rollout.api import ALL_STEPS, bucket
from opd_jax.rollout.sampling import FinishReason, SamplingParams

HEADER, TOKEN, FINISH, COMMIT, TURN = 1, 2, 3, 4, 5
_FRAME = struct.Struct("<II")
_TOKEN = struct.Struct("<BiiIfB")  # kind, row, position, token, logp, forced
_FINISH = struct.Struct("<BiB")    # kind, row, reason
_COMMIT = struct.Struct("<BI")     # kind, chunk
_TURN = struct.Struct("<BiI")      # kind, row, turn (multi-turn: the environment stepped it)
_BODY = {TOKEN: _TOKEN, FINISH: _FINISH, TURN: _TURN}
_MAX_RECORD = 1 << 20


def frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class TokenLog:
    """Appender. `append_*` buffer records; `commit()` writes them, a COMMIT, and fsyncs."""

    def __init__(self, path, header: dict, *, truncate_at: int | None = None):
        exists = os.path.exists(path)
        self.file = open(path, "r+b" if exists else "wb")
        if exists:
            self.file.truncate(truncate_at if truncate_at is not None else 0)
            self.file.seek(0, os.SEEK_END)
        self.chunks = 0
        self.buffer: list[bytes] = []
        if self.file.tell() == 0:
            self.buffer.append(frame(bytes([HEADER]) + json.dumps(header, sort_keys=True).encode()))
            self.commit()

    def append_token(self, row: int, position: int, token: int, logp: float,
                     forced: bool = False) -> None:
        self.buffer.append(frame(_TOKEN.pack(TOKEN, row, position, token, logp, forced)))

    def append_finish(self, row: int, reason: int) -> None:
        self.buffer.append(frame(_FINISH.pack(FINISH, row, reason)))

    def append_turn(self, row: int, turn: int) -> None:
        """Row `row`'s turn `turn` is complete and its environment has stepped on it."""
        self.buffer.append(frame(_TURN.pack(TURN, row, turn)))

    def commit(self) -> None:
        self.buffer.append(frame(_COMMIT.pack(COMMIT, self.chunks)))
        self.chunks += 1
        self.file.write(b"".join(self.buffer))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.buffer.clear()

    def close(self) -> None:
        self.file.close()


def read_log(path) -> tuple[dict | None, list[tuple], int]:
    """Committed content in order: (header, records, end).

    records: (kind, *fields) for each TOKEN (row, position, token, logp, forced), FINISH
    (row, reason) and TURN (row, turn) record of a committed chunk. `end` is the byte
    offset after the last COMMIT (where appending resumes).
    """
    header, records, staged, end = None, [], [], 0
    with open(path, "rb") as f:
        data = f.read()
    off = 0
    while off + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, off)
        payload = data[off + _FRAME.size: off + _FRAME.size + length]
        if length == 0 or length > _MAX_RECORD or len(payload) < length \
                or zlib.crc32(payload) != crc:
            break  # torn or corrupt: the log ends here
        off += _FRAME.size + length
        kind = payload[0]
        if kind == HEADER:
            header = json.loads(payload[1:].decode())
        elif kind in _BODY and len(payload) == _BODY[kind].size:
            staged.append(_BODY[kind].unpack(payload))
        elif kind == COMMIT and len(payload) == _COMMIT.size:
            records += staged
            staged, end = [], off
        else:
            break
    return header, records, end


def replay(path) -> tuple[dict | None, dict[int, list], dict[int, int], int]:
    """Committed content of a single-turn job: (header, {row: [(position, token, logp,
    forced)]}, {row: reason}, end)."""
    header, records, end = read_log(path)
    tokens, finished = {}, {}
    for kind, row, *rest in records:
        if kind == TOKEN:
            pos, tok, lp, forced = rest
            tokens.setdefault(row, []).append((pos, tok, lp, bool(forced)))
        elif kind == FINISH:
            finished[row] = rest[0]
    return header, tokens, finished, end


def job_header(prompt_BxP, lens_B, params: SamplingParams, seed, max_new_B, max_len,
               think_budget_B, row_ids_B) -> dict:
    """The job's identity: resuming a log written by a different job is an error."""
    h = hashlib.sha256()
    for x in (prompt_BxP, lens_B, max_new_B, think_budget_B, row_ids_B,
              *jax.tree.leaves(params)):
        h.update(np.asarray(x).tobytes())
    return dict(version=1, seed=int(seed), batch=len(lens_B), max_len=int(max_len),
                digest=h.hexdigest())


def _restore(model, prompt_BxP, lens_B, params, tokens, finished, **common):
    """State after teacher-forcing prompt + logged tokens; logged finishes applied."""
    B, P = prompt_BxP.shape
    logged = [sorted(tokens.get(b, [])) for b in range(B)]
    for b, recs in enumerate(logged):
        if [r[0] for r in recs] != list(range(lens_B[b], lens_B[b] + len(recs))):
            raise ValueError(f"token log row {b}: positions {[r[0] for r in recs][:8]} are "
                             f"not contiguous from the prompt length {lens_B[b]}")
    W = bucket(max(int(lens_B[b]) + len(logged[b]) for b in range(B)), 64)
    # histories now end in one column: rows need W + their remaining tokens + 1 slots
    left = max(int(common["max_new_B"][b]) - len(logged[b]) for b in range(B))
    max_len = max(common["max_len"], bucket(W + max(left, 0) + 1, 128))
    chunk, mask, resp, forced, logp = (np.zeros((B, W), np.int32), np.zeros((B, W), bool),
                                       np.zeros((B, W), bool), np.zeros((B, W), bool),
                                       np.zeros((B, W), np.float32))
    for b, recs in enumerate(logged):
        row = list(prompt_BxP[b, P - lens_B[b]:]) + [r[1] for r in recs]
        chunk[b, W - len(row):] = row
        mask[b, W - len(row):] = True
        resp[b, W - len(recs):] = len(recs) > 0
        logp[b, W - len(recs):] = [r[2] for r in recs]
        forced[b, W - len(recs):] = [r[3] for r in recs]
    state = engine.init_state(model, B, max_len, common["seed"],
                              row_ids_B=common["row_ids_B"],
                              think_budget_B=common["think_budget_B"],
                              window=params.stop_seqs_QxM.shape[1])
    state = engine.extend(model, state, jnp.asarray(chunk), jnp.asarray(mask),
                          start_turn_B=jnp.ones((B,), bool),
                          max_new_B=jnp.asarray(common["max_new_B"], jnp.int32),
                          response_BxW=jnp.asarray(resp), logp_BxW=jnp.asarray(logp),
                          forced_BxW=jnp.asarray(forced),
                          think_ids_2=params.think_ids_2)
    done_B = np.zeros(B, bool)
    reason_B = np.zeros(B, np.int32)
    for row, reason in finished.items():
        done_B[row], reason_B[row] = True, reason
    return state.replace(active_B=state.active_B & ~jnp.asarray(done_B),
                         finish_B=jnp.where(jnp.asarray(done_B), jnp.asarray(reason_B),
                                            state.finish_B))


def generate_logged(model, prompt_BxP, lens_B, params: SamplingParams, *, wal_path,
                    steps_per_call: int, seed, max_new_B, max_len, think_budget_B,
                    row_ids_B=None, max_chunks: int | None = None) -> engine.RolloutBatch:
    """Decode in chunks, logging each chunk; resume from `wal_path` if it holds records.

    max_chunks: stop after that many chunks (rows report BUDGET); for tests and pacing.
    """
    B = len(lens_B)
    row_ids_B = np.arange(B, dtype=np.int32) if row_ids_B is None else np.asarray(row_ids_B)
    common = dict(seed=seed, max_new_B=max_new_B, max_len=max_len,
                  think_budget_B=think_budget_B, row_ids_B=row_ids_B)
    header = job_header(prompt_BxP, lens_B, params, **common)
    truncate_at = None
    if os.path.exists(wal_path) and os.path.getsize(wal_path) > 0:
        old, tokens, finished, truncate_at = replay(wal_path)
        if old is not None and old != header:
            raise ValueError(f"token log {wal_path} belongs to another job ({old}); "
                             f"expected {header}")
        state = _restore(model, prompt_BxP, lens_B, params, tokens, finished, **common)
        if old is None:
            truncate_at = 0  # no committed header: start the file over
    else:
        from opd_jax.rollout.api import sample
        _, state = sample(model, prompt_BxP, lens_B, params, max_steps=0, **common)
    log = TokenLog(wal_path, header, truncate_at=truncate_at)
    try:
        chunks, logged = 0, set(finished) if truncate_at is not None else set()
        while bool(jnp.any(state.active_B)) and (max_chunks is None or chunks < max_chunks):
            before = int(state.cache.index)
            state = engine.decode(model, state, params, jnp.asarray(steps_per_call, jnp.int32))
            after = int(state.cache.index)
            _log_chunk(log, state, before, after, logged)
            chunks += 1
    finally:
        log.close()
    return engine.pack(state)


def _log_chunk(log: TokenLog, state: engine.RolloutState, before: int, after: int,
               logged: set) -> None:
    """Append the tokens sampled into slots (before, after], each row's finish, COMMIT."""
    tok, smp, frc, lp, present, finish, active = jax.device_get((
        state.tokens_BxS[:, before + 1:after + 1], state.sampled_BxS[:, before + 1:after + 1],
        state.forced_BxS[:, before + 1:after + 1], state.logp_BxS[:, before + 1:after + 1],
        state.present_BxS, state.finish_B, state.active_B))
    for b in range(tok.shape[0]):
        start = int(present[b, :before + 1].sum())  # position of the first new token
        k = 0
        for j in range(tok.shape[1]):
            if smp[b, j] or frc[b, j]:
                log.append_token(b, start + k, int(tok[b, j]), float(lp[b, j]), bool(frc[b, j]))
                k += 1
        if not active[b] and finish[b] != FinishReason.RUNNING and b not in logged:
            log.append_finish(b, int(finish[b]))
            logged.add(b)
    log.commit()


__all__ = ["ALL_STEPS", "TokenLog", "frame", "generate_logged", "read_log", "replay"]
