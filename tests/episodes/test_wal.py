"""Token write-ahead log framing: commits, torn tails and corruption. (Resuming episodes
from it: tests/episodes/test_play.py; SIGKILL of a training rollout:
tests/faults/test_rollout_kill.py.)"""
import os

from opd_jax.episodes.wal import FINISH, TOKEN, TokenLog, frame, read_log


def replay(path):
    """(header, {row: [(position, token, logp, forced)]}, {row: reason}, end)."""
    header, records, end = read_log(path)
    tokens, finished = {}, {}
    for kind, row, *rest in records:
        if kind == TOKEN:
            pos, tok, lp, forced = rest
            tokens.setdefault(row, []).append((pos, tok, lp, bool(forced)))
        elif kind == FINISH:
            finished[row] = rest[0]
    return header, tokens, finished, end


def test_records_commit_torn_tail_and_corruption(tmp_path):
    path = tmp_path / "log"
    log = TokenLog(path, {"job": 1})
    log.append_token(0, 5, 42, -1.5)
    log.append_token(1, 3, 7, -0.25, forced=True)
    log.commit()
    log.append_token(0, 6, 43, -2.0)
    log.append_finish(0, 1)
    log.commit()
    log.append_token(1, 4, 8, -1.0)  # buffered, never committed
    log.close()
    header, toks, fin, end = replay(path)
    assert header == {"job": 1} and fin == {0: 1} and end == os.path.getsize(path)
    assert toks == {0: [(5, 42, -1.5, False), (6, 43, -2.0, False)], 1: [(3, 7, -0.25, True)]}
    data = path.read_bytes()
    for cut in (1, 9, 20):  # torn last chunk: only the first chunk survives
        path.write_bytes(data[:-cut])
        _, toks, fin, _ = replay(path)
        assert fin == {} and toks == {0: [(5, 42, -1.5, False)], 1: [(3, 7, -0.25, True)]}
    bad = bytearray(data)
    bad[-3] ^= 0xFF  # flip a byte of the last COMMIT: its CRC fails
    path.write_bytes(bytes(bad))
    assert replay(path)[2] == {}
    # appending after a torn tail truncates it first
    path.write_bytes(data + frame(b"\x02garbage")[:-2])
    log = TokenLog(path, {"job": 1}, truncate_at=replay(path)[3])
    log.append_finish(1, 2)
    log.commit()
    log.close()
    assert replay(path)[2] == {0: 1, 1: 2}
