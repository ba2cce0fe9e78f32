"""A teacher with another tokenizer than the student's: the student's text is re-tokenized
for the teacher, scored, and the teacher's log-probs are carried back to the student's
tokens by character spans.

    ids_t, assign, exact = map_response(student_tok, teacher_tok, response_ids)
    lp_s = gather_values(assign, lp_t, len(response_ids))    # per student token

What is exact and what approximates. The teacher's log-prob of the student's token t is
log P_T(text[a_t:b_t] | text[:a_t]) under the teacher's own tokenization of the text: the
sum of the log-probs of the teacher tokens whose spans tile [a_t, b_t). That is exact
(for that tokenization; other tokenizations of the same string are ignored, as every
cross-tokenizer method does) whenever both ends of t's span are teacher token boundaries,
which holds for every token when the teacher's tokenization is finer than the student's
(a character-level teacher and a BPE student). A teacher token that straddles a student
boundary is given wholly to the student token in which it ends: the sum over every stretch
of text where both tokenizations have a boundary is then still exact, but the split of that
stretch between its student tokens is an approximation (`exact` says which tokens are
exact; `align_logprobs(..., exact_only=True)` masks the others). A student token that
decodes to no text (a special token other than end-of-sequence) has no teacher value: it is
not exact. Special tokens are carried over whole, by their string (the student's
end-of-sequence token becomes the teacher's, whatever each calls it); an id the student
tokenizer has no string for (a padding row of the embedding) gets no value (masked).

With equal tokenizers every span is the teacher's own token: the values are the plain
path's, exactly (`tests/trainers/test_cross_tokenizer.py`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opd_jax.models.tokenizers import tokenizer_fingerprint


def char_spans(tokenizer, ids: Sequence[int], skip_special: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
    """(decode(ids), the [start, end) character span of each id in it), from incremental
    decoding (a byte-level token that ends inside a multi-byte character gets an empty span
    and the next token the whole character). `skip_special`: special tokens decode to
    nothing (empty spans), as a server that echoes them as empty strings shows them."""
    spans, prev = [], 0
    text = ""
    kw = {"skip_special_tokens": True} if skip_special else {}
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(list(ids[:k]), **kw)
        # a decoding that rewrites earlier text (merged bytes): keep spans monotone
        end = max(len(text), prev)
        spans.append((prev, end))
        prev = end
    return text, spans


def retokenize(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The teacher's ids for `text` (no special tokens added) and their character spans."""
    ids = _encode(tokenizer, text)
    decoded, spans = char_spans(tokenizer, ids)
    if decoded != text:         # lossy: characters the teacher has no token for (<unk>)
        spans = _spans_in(text, [decoded[a:b] for a, b in spans])
    return ids, spans


def _spans_in(text: str, pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Spans in `text` of tokens whose decoded `pieces` do not spell it (a tokenizer that
    encodes what it lacks as <unk>): a piece that reads the text at its place covers it; one
    that does not (the <unk>) covers the text up to where the next piece reads it, at least
    one character. So an unknown character is the teacher's <unk> token, scored as such (a
    teacher gives it little probability), not text that shifts every later span."""
    spans, pos = [], 0
    for k, piece in enumerate(pieces):
        if piece and text.startswith(piece, pos):
            end = pos + len(piece)
        elif pos >= len(text):
            end = pos
        else:
            nxt = next((q for q in pieces[k + 1:] if q), None)
            found = text.find(nxt, pos + 1) if nxt else -1
            end = found if found > pos else (len(text) if nxt is None else pos + 1)
        spans.append((pos, end))
        pos = end
    return spans


def _encode(tokenizer, text: str) -> list[int]:
    """`text`'s ids, no special tokens added (where the tokenizer takes that option)."""
    ids = tokenizer.encode(text, add_special_tokens=False) if _takes_special(tokenizer) \
        else tokenizer.encode(text)
    return [int(i) for i in ids]


def _takes_special(tokenizer) -> bool:
    try:
        tokenizer.encode("a", add_special_tokens=False)
        return True
    except TypeError:
        return False


def align_assign(student_spans: Sequence[tuple[int, int]],
                 teacher_spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(assign [U]: the student token each teacher token's log-prob goes to, -1 for none;
    exact [S] bool): a teacher token goes to the student token in which it ends (module
    docstring); a student token is exact when its span is tiled by the teacher tokens
    given to it."""
    S = len(student_spans)
    starts = np.array([a for a, _ in student_spans], np.int64)
    ends = np.array([b for _, b in student_spans], np.int64)
    assign = np.full(len(teacher_spans), -1, np.int64)
    got = np.zeros(S, bool)
    for u, (c, d) in enumerate(teacher_spans):
        if d <= c:
            continue
        t = int(np.searchsorted(ends, d, side="left"))   # the token holding char d - 1
        if t < S and starts[t] <= d - 1 < ends[t]:
            assign[u], got[t] = t, True
    boundaries = {0} | {b for _, b in teacher_spans}
    exact = np.array([got[t] and a in boundaries and b in boundaries and b > a
                      for t, (a, b) in enumerate(student_spans)], bool)
    return assign, exact


def gather_values(assign: np.ndarray, teacher_lp, n_student: int) -> np.ndarray:
    """Per student token: the sum of the teacher log-probs assigned to it; NaN for none."""
    vals, got = np.zeros(n_student), np.zeros(n_student, bool)
    for u, t in enumerate(assign):
        if t >= 0:
            vals[t] += float(teacher_lp[u])
            got[t] = True
    return np.where(got, vals, np.nan)


def align_logprobs(student_spans: Sequence[tuple[int, int]],
                   teacher_spans: Sequence[tuple[int, int]], teacher_lp: Sequence[float],
                   exact_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(values [S], exact [S] bool) per student token: the sum of the log-probs of the
    teacher tokens that end inside its span (module docstring); NaN where none does, and,
    with `exact_only`, where the token is not exact."""
    assign, exact = align_assign(student_spans, teacher_spans)
    vals = gather_values(assign, teacher_lp, len(student_spans))
    return (np.where(exact, vals, np.nan) if exact_only else vals), exact


def map_response(student_tok, teacher_tok, response_ids: Sequence[int]
                 ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A student response in the teacher's tokens: (teacher ids, assign [U] -> student
    token, exact [S]). Runs of text tokens are decoded and re-tokenized; a special token is
    carried over by its string (the end-of-sequence token by role: the student's EOS
    becomes the teacher's; added control tokens such as <think> are specials too), exact;
    an id with no string in the student tokenizer (a padding
    row of the embedding) or a special the teacher lacks gets no teacher token (masked)."""
    S, V = len(response_ids), len(student_tok)
    special = set(getattr(student_tok, "all_special_ids", []) or [])
    if hasattr(student_tok, "get_added_vocab"):          # control tokens (<think>, <|user|>)
        special |= set(student_tok.get_added_vocab().values())
    eos_s, eos_t = student_tok.eos_token_id, getattr(teacher_tok, "eos_token_id", None)
    t_ids: list[int] = []
    assign: list[int] = []
    exact = np.zeros(S, bool)
    i = 0
    while i < S:
        sid = int(response_ids[i])
        if sid in special or sid >= V:
            tid = None
            if sid == eos_s:
                tid = eos_t
            elif sid < V:
                tid = _teacher_special(teacher_tok, student_tok.convert_ids_to_tokens(sid))
            if tid is not None:
                t_ids.append(int(tid))
                assign.append(i)
                exact[i] = True
            i += 1
            continue
        j = i
        while j < S and int(response_ids[j]) not in special and int(response_ids[j]) < V:
            j += 1
        text, spans = char_spans(student_tok, response_ids[i:j])
        ids_t, spans_t = retokenize(teacher_tok, text)
        a, ex = align_assign(spans, spans_t)
        t_ids += ids_t
        assign += [i + int(x) if x >= 0 else -1 for x in a]
        exact[i:j] = ex
        i = j
    return t_ids, np.asarray(assign, np.int64), exact


def cut_response(t_ids: Sequence[int], assign: np.ndarray, keep: int
                 ) -> tuple[list[int], np.ndarray]:
    """A teacher response cut to its first `keep` tokens (the teacher's context ends
    there): every student token with a teacher token cut loses all of its teacher tokens,
    the one the cut splits included (its kept pieces alone would give it part of its
    log-prob), so it gets no value (masked)."""
    assign = np.asarray(assign, np.int64)
    if len(t_ids) <= keep:
        return list(t_ids), assign
    cut = assign[keep:]
    kept = assign[:keep].copy()
    if (cut >= 0).any():
        kept[kept >= cut[cut >= 0].min()] = -1
    return list(t_ids[:keep]), kept


def _teacher_special(teacher_tok, token: str) -> int | None:
    """The teacher's id of special token string `token`, or None when it has none."""
    vocab = teacher_tok.get_vocab() if hasattr(teacher_tok, "get_vocab") else {}
    return vocab.get(token)


class TokenString:
    """The text of one token id as it reads inside a text: decoded after an anchor token and
    the anchor's text removed. Decoding the id alone is not that for SentencePiece
    tokenizers, whose decoders drop the leading space of a text's first token ("▁the"
    alone decodes to "the", after "a" to " the"); byte-level BPE and character vocabularies
    give the same either way."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # (a decode-only tokenizer has no anchor: each id decoded alone)
        anchor = _encode(tokenizer, "a")[:1] if hasattr(tokenizer, "encode") else []
        self.anchor = anchor if anchor and tokenizer.decode(anchor) == "a" else []

    def __call__(self, i: int) -> str:
        if not self.anchor:
            return self.tokenizer.decode([int(i)])
        s = self.tokenizer.decode(self.anchor + [int(i)])
        return s[1:] if s.startswith("a") else self.tokenizer.decode([int(i)])


class StringIds:
    """Token string -> id for servers that send top-k tokens as strings: the text of every
    id of the tokenizer (`TokenString`); a string that several ids read as (byte fallbacks,
    special tokens) maps to None."""

    def __init__(self, tokenizer):
        self.decode = TokenString(tokenizer)
        first: dict[str, int | None] = {}
        for i in range(len(tokenizer)):
            s = self.decode(i)
            first[s] = None if s in first else i
        self.ids = first

    def __call__(self, s: str) -> int | None:
        return self.ids.get(s)


def vocab_map(teacher_tok, student_tok, teacher_vocab: int) -> np.ndarray:
    """[teacher_vocab] int64: the student id whose text is a teacher id's text (the one id
    the student tokenizer decodes to it), the end-of-sequence tokens by role, -1 where the
    student has no single token for it (a multi-token string, an id past the teacher
    tokenizer): the shared vocabulary of the top-k signal across tokenizers. Two tokenizers
    with one fingerprint share every id (the identity)."""
    if _same_tokenizer(teacher_tok, student_tok):
        return np.arange(int(teacher_vocab), dtype=np.int64)
    names, text = StringIds(student_tok), TokenString(teacher_tok)
    out = np.full(int(teacher_vocab), -1, np.int64)
    for tid in range(min(len(teacher_tok), int(teacher_vocab))):
        sid = names(text(tid))
        if sid is not None:
            out[tid] = sid
    eos_t = getattr(teacher_tok, "eos_token_id", None)
    if eos_t is not None and eos_t < teacher_vocab:
        out[eos_t] = student_tok.eos_token_id
    return out


def _same_tokenizer(a, b) -> bool:
    try:
        return tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    except (AttributeError, TypeError):     # not an HF tokenizer (a test's toy)
        return False


def one_to_one(assign: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """[S] int64: for each student token, the one teacher token that is exactly it (its span
    is that teacher token's), else -1: the positions where the teacher's next-token
    distribution is a distribution over the student's next token."""
    count = np.bincount(assign[assign >= 0], minlength=len(exact))
    out = np.full(len(exact), -1, np.int64)
    for u, t in enumerate(assign):
        if t >= 0 and exact[t] and count[t] == 1:
            out[t] = u
    return out


def map_topk(ids_K: np.ndarray, lp_K: np.ndarray, vmap: np.ndarray) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """One position's teacher top-k in student ids: ids through `vmap` (-1: no student
    token, its mass left to the tail), two teacher ids of one student id merged
    (log-sum-exp into the first slot, the second unused)."""
    sids = np.where(ids_K >= 0, vmap[np.clip(ids_K, 0, len(vmap) - 1)], -1)
    out_ids, out_lp = np.full_like(sids, -1), np.full(lp_K.shape, -np.inf)
    slot = {}
    for i, (sid, lp) in enumerate(zip(sids, lp_K)):
        if sid < 0:
            continue
        if sid in slot:
            j = slot[sid]
            out_lp[j] = np.logaddexp(out_lp[j], lp)
        else:
            slot[sid] = i
            out_ids[i], out_lp[i] = sid, lp
    return out_ids, out_lp
