"""Token write-ahead log: resume a killed rollout job from its last logged token.

One append-only file per job. A record is framed as

    u32 length | u32 crc32(payload) | payload         (little endian)

and the payload's first byte is its kind: HEADER (JSON: the job's identity), TOKEN (row,
position, token, logp), FINISH (row, reason), TURN (row, turn: a multi-turn episode's
environment stepped on that turn) or COMMIT (chunk number). The episode runner
(`opd_jax.episodes.runner`) decodes `steps_per_call` steps at a time; after each chunk it
appends the chunk's tokens, the rows that finished, and a COMMIT, then fsyncs once.
Durability window: one chunk (at most `steps_per_call` tokens per row are lost by a kill;
they are regenerated, identically).

`read_log` returns the records in order up to the last COMMIT; a torn or corrupt record
(short read, bad length, bad CRC) ends the log, so an uncommitted tail is dropped and the
file is truncated there before appending. A resumed job re-prefills prompt + logged
tokens (teacher-forced), then samples on: every draw comes from the (seed, row, position)
stream, so the result equals an uninterrupted run, and rows are continued, never restarted
(restarting the unfinished ones would bias the batch toward short responses).
"""
from __future__ import annotations

import json
import os
import struct
import zlib

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
