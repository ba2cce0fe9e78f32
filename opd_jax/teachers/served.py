"""Teachers behind an inference server: the student's sequences are sent as token ids and
the server's prompt log-probs come back, as the sampled-token signal or the teacher's top-k.

A bank entry (`teachers.paths` value) names the protocol and the server:

    "vllm+http://127.0.0.1:8000?model=Qwen/Qwen3-8B"   POST /v1/completions, prompt_logprobs
    "sglang+http://127.0.0.1:30000"                    POST /generate, return_logprob
    "openai+http://127.0.0.1:8080"                     POST /v1/completions, echo + logprobs
                                                       (llama.cpp's llama-server and
                                                       llama-cpp-python's server)

Every protocol is turned into the same per-row record (`PositionScores`): for each position
j >= 1 of the sent ids, the log-prob of token j given tokens < j, and up to k
(id, log-prob) pairs of the teacher's most likely tokens there.

What the client does not trust (each found by `ServedTeacher.probe` at start-up, on a known
sequence, before any rollout):
- **No or misaligned log-probs**: a response without them, or with another count, fails
  naming the server.
- **Another vocabulary**: where the server returns token strings, each probe id's string
  must be the student tokenizer's decoding of that id.
- **Inconsistent log-probs** (vllm, sglang): where the sampled token's log-prob disagrees
  with its own entry in the top-k at the same position, the client reads the top-k only.
- **Shifted echo log-probs** (openai: llama-cpp-python 0.3 echoes a prompt that does not
  open with the model's BOS one index early): found per first token of a row from the
  server's own next-token log-probs (`ServedTeacher._shift`), then read from the index
  before. Either way a sampled token outside the top-k is masked (`valid` 0) and counted,
  and a share above `max_missing` in a request refuses the batch.
- **Temperature**: the server is asked at the objective's temperature, never its default;
  when that is not 1, the probe asks at both and refuses a server whose log-probs do not
  change (vLLM's default `--logprobs-mode raw_logprobs` returns T = 1 log-probs whatever
  the request says: slime #2085, verl #6867).
Requests are batched (`batch_rows`), time out (`timeout_s`) and are retried a bounded number
of times (`retries`, exponential backoff) on connection errors and 5xx answers; a 4xx
answer fails at once with the server's message.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

import numpy as np

from opd_jax.teachers.cross_tokenizer import (StringIds, TokenString, align_assign, char_spans,
                                              one_to_one)

log = logging.getLogger(__name__)

PROTOCOLS = ("vllm", "sglang", "openai")
PROBE_TEXT = "The capital of France is Paris. 12 + 30 = 42"
CONSISTENCY_TOL = 1e-3        # nats: a token's log-prob vs its own top-k entry


class ServedTeacherError(RuntimeError):
    """A served teacher answered something the client cannot train on (names the server)."""


def is_served(path: str) -> bool:
    """True for a "<protocol>+<scheme>://..." teacher (a malformed one too: `parse_spec`
    then says what is wrong, rather than it being read as a missing checkpoint folder)."""
    return isinstance(path, str) and re.match(r"^[A-Za-z0-9_]+\+[A-Za-z]+://", path) is not None


def parse_spec(spec: str) -> tuple[str, str, str | None]:
    """"vllm+http://host:port?model=NAME" -> (protocol, base url, model or None)."""
    proto, sep, url = spec.partition("+")
    if not sep or proto not in PROTOCOLS or not url.startswith(("http://", "https://")):
        raise ValueError(f"served teacher {spec!r}: expected <protocol>+http(s)://host:port "
                         f"with protocol one of {PROTOCOLS}")
    parts = urllib.parse.urlsplit(url)
    model = urllib.parse.parse_qs(parts.query).get("model", [None])[0]
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    return proto, base, model


@dataclasses.dataclass
class PositionScores:
    """One row's server answer, per position j of the sent ids (j = 0 has none): `lp[j]`
    the log-prob of ids[j] given ids[:j] (NaN: not given), `top_ids[j]` / `top_lp[j]` the
    teacher's most likely tokens there, most likely first (id -1 / -inf: unused), and
    `strings[j]` the server's string for ids[j] where it gives one (else None)."""
    lp: np.ndarray          # [L] float64
    top_ids: np.ndarray     # [L, K] int64
    top_lp: np.ndarray      # [L, K] float64
    strings: list

    @classmethod
    def empty(cls, n: int, k: int) -> PositionScores:
        return cls(np.full(n, np.nan), np.full((n, k), -1, np.int64),
                   np.full((n, k), -np.inf), [None] * n)

    def set_top(self, j: int, pairs: Sequence[tuple[int, float]]) -> None:
        pairs = sorted(pairs, key=lambda p: -p[1])[:self.top_ids.shape[1]]
        for i, (tid, lp) in enumerate(pairs):
            self.top_ids[j, i], self.top_lp[j, i] = tid, lp

    def top_entry(self, j: int, tid: int) -> float | None:
        hit = np.nonzero(self.top_ids[j] == tid)[0]
        return float(self.top_lp[j, hit[0]]) if len(hit) else None


# -- protocol parsers (pure: tested on hand-built responses) ----------------------------------
def _need(cond: bool, server: str, what: str) -> None:
    if not cond:
        raise ServedTeacherError(f"teacher server {server}: {what}")


def parse_vllm(choice: dict, ids: Sequence[int], k: int, server: str = "?") -> PositionScores:
    """A vLLM /v1/completions choice with `prompt_logprobs`: a list with one entry per
    prompt token, None first, then {"<id>": {"logprob", "rank", "decoded_token"}} holding
    the prompt token and the top-`k` (by rank)."""
    plp = choice.get("prompt_logprobs")
    _need(isinstance(plp, list), server, "returned no prompt_logprobs (vLLM: request "
          "'prompt_logprobs'; is this a vLLM server?)")
    _need(len(plp) == len(ids), server, f"returned {len(plp)} prompt log-probs for "
          f"{len(ids)} prompt tokens")
    out = PositionScores.empty(len(ids), k)
    for j in range(1, len(ids)):
        entry = plp[j]
        _need(isinstance(entry, dict) and str(ids[j]) in entry, server,
              f"position {j}: no log-prob for prompt token {ids[j]}")
        tok = entry[str(ids[j])]
        out.lp[j] = float(tok["logprob"])
        out.strings[j] = tok.get("decoded_token")
        ranked = [(int(t), float(v["logprob"])) for t, v in entry.items()
                  if v.get("rank") is None or int(v["rank"]) <= k]
        out.set_top(j, ranked)
    return out


def parse_sglang(item: dict, ids: Sequence[int], k: int, server: str = "?") -> PositionScores:
    """An SGLang /generate answer with `return_logprob` from position 0: meta_info's
    `input_token_logprobs` [[logprob | None, id, text | None], ...] and
    `input_top_logprobs` [None | [[logprob, id, text], ...], ...]."""
    meta = item.get("meta_info", {})
    tok = meta.get("input_token_logprobs")
    _need(isinstance(tok, list), server, "returned no input_token_logprobs (SGLang: request "
          "return_logprob with logprob_start_len 0)")
    _need(len(tok) == len(ids), server, f"returned {len(tok)} input log-probs for "
          f"{len(ids)} input tokens")
    top = meta.get("input_top_logprobs") or [None] * len(ids)
    out = PositionScores.empty(len(ids), k)
    for j in range(1, len(ids)):
        lp, tid = tok[j][0], tok[j][1]
        _need(int(tid) == int(ids[j]), server, f"position {j}: log-prob of token {tid}, "
              f"expected the sent token {ids[j]} (misaligned)")
        _need(lp is not None, server, f"position {j}: no log-prob for token {ids[j]}")
        out.lp[j] = float(lp)
        out.strings[j] = tok[j][2] if len(tok[j]) > 2 else None
        if k and top[j]:
            out.set_top(j, [(int(e[1]), float(e[0])) for e in top[j]])
    return out


def parse_openai(choice: dict, ids: Sequence[int], k: int, token_id: Callable[[str], int | None],
                 text: str, spans: Sequence[tuple[int, int]], shift: int = 0,
                 server: str = "?") -> PositionScores:
    """An OpenAI-style legacy completion with `echo` and `logprobs` (llama.cpp, llama-cpp-
    python) for the prompt `text` (our `ids` decoded; `spans` their character spans):
    logprobs {tokens: [str], token_logprobs: [float | None], top_logprobs: [None |
    {str: float}]}, the echoed prompt first (a server may leave out leading special tokens)
    and then the generated token. The server tokenized the text itself: each of our tokens
    takes the values of the one server token that is exactly it (same span), else NaN.
    `shift` 1: the server's distribution at echo index u is the one that predicts token
    u + 1 (llama-cpp-python 0.3 without a leading BOS), so token u's values are read from
    index u - 1, its log-prob from that dictionary. Top-k tokens come as strings:
    `token_id(s)` maps one to its id (None: dropped)."""
    lps = choice.get("logprobs") or {}
    toks, vals = lps.get("tokens"), lps.get("token_logprobs")
    _need(isinstance(toks, list) and isinstance(vals, list), server,
          "returned no echoed logprobs (request echo=true with logprobs)")
    top = lps.get("top_logprobs") or [None] * len(vals)
    joined = "".join(toks)
    o = next((o for o in range(len(text)) if joined.startswith(text[o:])), None)
    _need(o is not None and len(text) - o >= len(text) // 2, server,
          f"echoed tokens {''.join(toks)[:60]!r}... are not the prompt sent "
          f"({text[:60]!r}...): misaligned")
    # The echo ends where the text does, except for as many empty tokens there as ours has
    # (trailing specials a server echoes as ""); what follows is the generated token.
    tail = sum(1 for a, b in spans if a == b == len(text))
    s_spans, c = [], o
    for t in toks:
        if c + len(t) > len(text) or (c == len(text) and s_spans and (t or tail == 0)):
            break
        tail -= c == len(text) and bool(s_spans)
        s_spans.append((c, c + len(t)))
        c += len(t)
    assign, exact = align_assign(spans, s_spans)
    u_of = one_to_one(assign, exact)
    # Empty tokens (special tokens a server echoes as ""): paired in order where both sides
    # have the same number of them at one character offset; others get no value.
    ours, theirs = {}, {}
    for j, (a, b) in enumerate(spans):
        if a == b:
            ours.setdefault(a, []).append(j)
    for u, (a, b) in enumerate(s_spans):
        if a == b:
            theirs.setdefault(a, []).append(u)
    for c, js in ours.items():
        if len(theirs.get(c, [])) == len(js):
            for j, u in zip(js, theirs[c]):
                u_of[j] = u
    out = PositionScores.empty(len(ids), k)
    for j in range(1, len(ids)):
        u = int(u_of[j])
        d = u - shift
        if u < 0 or d < 0 or top[d] is None and (shift or vals[u] is None):
            continue
        out.strings[j] = toks[u]
        if shift == 0 and vals[u] is not None:
            out.lp[j] = float(vals[u])
        elif top[d] is not None and toks[u] in top[d]:
            out.lp[j] = float(top[d][toks[u]])
        if k and top[d]:
            pairs = [(token_id(s), float(v)) for s, v in top[d].items()]
            out.set_top(j, [(t, v) for t, v in pairs if t is not None])
    return out


# -- the client --------------------------------------------------------------------------------
class ServedTeacher:
    """One teacher behind a server (module docstring). `score(rows)` returns a
    `PositionScores` per row of token ids; `probe()` checks the server first."""

    def __init__(self, spec: str, tokenizer, *, top_k: int = 0, temperature: float = 1.0,
                 timeout_s: float = 60.0, retries: int = 3, batch_rows: int = 8,
                 max_missing: float = 0.1, post=None):
        self.spec = spec
        self.protocol, self.url, self.model = parse_spec(spec)
        if not temperature > 0:
            raise ValueError(f"served teacher {spec}: temperature={temperature}, expected > 0")
        if top_k < 0 or retries < 0 or batch_rows < 1 or timeout_s <= 0 or \
                not 0 <= max_missing <= 1:
            raise ValueError(f"served teacher {spec}: top_k={top_k} (>= 0), retries={retries} "
                             f"(>= 0), batch_rows={batch_rows} (>= 1), timeout_s={timeout_s} "
                             f"(> 0), max_missing={max_missing} (in [0, 1])")
        self.tokenizer, self.top_k, self.temperature = tokenizer, int(top_k), float(temperature)
        self.timeout_s, self.retries, self.batch_rows = timeout_s, retries, batch_rows
        self.max_missing = max_missing
        self._post = post or self._http_post
        self._strings = StringIds(tokenizer) if self.protocol == "openai" else None
        self.top_only = False          # set by probe(): the server's sampled log-probs are off
        self.shifts: dict = {}         # openai: (first token, T) -> echo shift (`_shift`)
        self.stats = {"requests": 0, "retries": 0, "rows": 0, "missing": 0, "scored": 0}

    # HTTP ------------------------------------------------------------------------------
    def _http_post(self, path: str, payload: dict, timeout: float):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())

    def post(self, path: str, payload: dict):
        """POST with a timeout and bounded retries (connection errors, timeouts, 5xx and 429,
        a cut or unparsable answer)."""
        err = None
        for attempt in range(self.retries + 1):
            self.stats["requests"] += 1
            try:
                return self._post(path, payload, self.timeout_s)
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")[:300] if hasattr(e, "read") else ""
                if e.code < 500 and e.code != 429:           # 429: too many requests
                    raise ServedTeacherError(f"teacher server {self.url}{path} answered HTTP "
                                             f"{e.code}: {body}") from None
                err = f"HTTP {e.code}: {body}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError,
                    http.client.HTTPException, json.JSONDecodeError) as e:
                err = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.retries:
                self.stats["retries"] += 1
                time.sleep(min(0.25 * 2 ** attempt, 4.0))
        raise ServedTeacherError(f"teacher server {self.url}{path}: no answer after "
                                 f"{self.retries + 1} tries ({err}); is it running?")

    # one batch -------------------------------------------------------------------------
    def _request(self, rows: Sequence[Sequence[int]], k: int, temperature: float
                 ) -> list[PositionScores]:
        rows = [[int(x) for x in r] for r in rows]
        if self.protocol == "vllm":
            payload = {"prompt": rows, "max_tokens": 1, "temperature": temperature,
                       "prompt_logprobs": k}
            if self.model:
                payload["model"] = self.model
            ans = self.post("/v1/completions", payload)
            choices = sorted(ans.get("choices", []), key=lambda c: c.get("index", 0))
            _need(len(choices) == len(rows), self.url, f"{len(choices)} choices for "
                  f"{len(rows)} prompts")
            return [parse_vllm(c, r, k, self.url) for c, r in zip(choices, rows)]
        if self.protocol == "sglang":
            payload = {"input_ids": rows, "return_logprob": True, "logprob_start_len": 0,
                       "top_logprobs_num": k, "return_text_in_logprobs": True,
                       "sampling_params": {"max_new_tokens": 1, "temperature": temperature}}
            ans = self.post("/generate", payload)
            ans = ans if isinstance(ans, list) else [ans]
            _need(len(ans) == len(rows), self.url, f"{len(ans)} answers for {len(rows)} rows")
            return [parse_sglang(a, r, k, self.url) for a, r in zip(ans, rows)]
        out = []
        for r in rows:       # one prompt per request, as text (llama-cpp-python takes no ids)
            text = self.tokenizer.decode(list(r))
            # the server echoes special tokens as "" (or not at all): align on visible text
            vis, spans = char_spans(self.tokenizer, r, skip_special=True)
            shift = self._shift(r, text, vis, spans, k, temperature)
            choice = self._complete(text, k, temperature, echo=True)
            out.append(parse_openai(choice, r, k, self._strings, vis, spans, shift, self.url))
        return out

    def _complete(self, text: str, k: int, temperature: float, echo: bool) -> dict:
        payload = {"prompt": text, "max_tokens": 1, "echo": echo, "logprobs": max(k, 1),
                   "temperature": temperature}
        if self.model:
            payload["model"] = self.model
        return (self.post("/v1/completions", payload).get("choices") or [{}])[0]

    def _shift(self, ids, text, vis, spans, k, temperature) -> int:
        """Whether the server's echoed distributions sit at their token (0) or one index
        early (1), found once per first token of a row (it depends on whether the prompt
        opens with the model's BOS) from the server's own generation path: the top-k it
        gives for the token after a prefix (no echo) is compared with the echoed
        distribution at that token's index and at the index before."""
        key = (int(ids[0]), float(temperature))
        if key in self.shifts:
            return self.shifts[key]
        k = max(k, 5)
        echo = self._complete(text, k, temperature, echo=True)
        cand = {}
        for shift in (0, 1):
            cand[shift] = parse_openai(echo, ids, k, self._strings, vis, spans, shift, self.url)
        # a position in the middle of the row that the server tokenized like us
        js = [j for j in range(2, len(ids)) if not np.isnan(cand[0].lp[j])
              and cand[0].top_ids[j, 0] >= 0 and cand[1].top_ids[j, 0] >= 0]
        _need(bool(js), self.url, "echoed no log-probs this client can align to its tokens")
        j = js[len(js) // 2]
        prefix = self.tokenizer.decode(list(ids[:j]))         # the text before token j
        gen = self._complete(prefix, k, temperature, echo=False)
        g = (gen.get("logprobs") or {}).get("top_logprobs") or [None]
        _need(isinstance(g[0], dict), self.url, "returned no log-probs for a generated token")
        ref = {self._strings(s): v for s, v in g[0].items() if self._strings(s) is not None}

        def dist(ps):
            common = [(ref[t], v) for t, v in zip(ps.top_ids[j], ps.top_lp[j]) if t in ref]
            return np.mean([abs(a - b) for a, b in common]) if common else np.inf
        d0, d1 = dist(cand[0]), dist(cand[1])
        _need(min(d0, d1) < 0.05, self.url, f"its echoed log-probs match its own next-token "
              f"log-probs at neither their index nor the one before (mean |diff| {d0:.3g} / "
              f"{d1:.3g} nats); cannot align them")
        self.shifts[key] = int(d1 < d0)
        if self.shifts[key]:
            log.warning("teacher server %s: echoed log-probs sit one position early (rows "
                        "opening with token %d); reading each token's values from the index "
                        "before it", self.url, key[0])
        return self.shifts[key]

    # checks ------------------------------------------------------------------------------
    def probe(self) -> dict:
        """Check the server on a known sequence (module docstring); returns what it found."""
        ids = [int(x) for x in self.tokenizer.encode(PROBE_TEXT)]
        if len(ids) < 4:
            raise ValueError(f"probe text encodes to {len(ids)} tokens; expected >= 4")
        k = max(self.top_k, 5)
        (got,) = self._request([ids], k, self.temperature)
        text = self._strings.decode if self._strings else TokenString(self.tokenizer)
        mismatched = [(j, ids[j], got.strings[j]) for j in range(1, len(ids))
                      if got.strings[j] is not None and got.strings[j] != text(ids[j])]
        if mismatched:
            j, tid, s = mismatched[0]
            raise ServedTeacherError(
                f"teacher server {self.url} uses a different vocabulary: token {tid} at "
                f"probe position {j} is {text(tid)!r} here and {s!r} "
                f"there ({len(mismatched)} of {len(ids) - 1} positions differ)")
        pairs = [(got.lp[j], got.top_entry(j, ids[j])) for j in range(1, len(ids))]
        both = [(a, b) for a, b in pairs if b is not None and not math.isnan(a)]
        off = [abs(a - b) for a, b in both if abs(a - b) > CONSISTENCY_TOL]
        if any(math.isnan(a) for a, _ in pairs) and not both:
            raise ServedTeacherError(f"teacher server {self.url} returned no log-probs for "
                                     f"the probe's tokens")
        with_top = sum(bool((got.top_ids[j] >= 0).any()) for j in range(1, len(ids)))
        if self.top_k > 0 and with_top * 2 < len(ids) - 1:
            raise ServedTeacherError(
                f"teacher server {self.url} returned top-k log-probs at {with_top} of "
                f"{len(ids) - 1} probe positions (asked for {k} per position): a top-k "
                f"signal needs them (does the server honour the request's top-k field?)")
        self.top_only = bool(off) and len(off) * 2 >= len(both)
        if self.top_only:
            log.warning("teacher server %s: the sampled tokens' log-probs disagree with their "
                        "own top-%d entries at %d of %d probe positions (max %.3g nats: "
                        "shifted echo log-probs); reading the top-k dictionaries only", self.url,
                        k, len(off), len(both), max(off))
        found = {"positions": len(ids) - 1, "inconsistent": len(off), "top_only": self.top_only}
        if self.protocol == "openai":
            found["shift"] = self.shifts[(ids[0], self.temperature)]
        if self.temperature != 1.0:
            (at1,) = self._request([ids], k, 1.0)
            a, b = got.lp[1:], at1.lp[1:]
            if self.top_only:
                a, b = got.top_lp[1:, 0], at1.top_lp[1:, 0]
            same = np.allclose(a, b, atol=1e-6, equal_nan=True)
            if same:
                raise ServedTeacherError(
                    f"teacher server {self.url} returns the same log-probs at temperature "
                    f"{self.temperature} as at 1: it ignores the request's temperature for "
                    f"prompt log-probs (vLLM: start it with --logprobs-mode "
                    f"processed_logprobs), and scoring the teacher at another temperature "
                    f"than the student is wrong; use temperature 1 or fix the server")
            found["temperature_honoured"] = True
        return found

    # scoring -----------------------------------------------------------------------------
    def score(self, rows: Sequence[Sequence[int]], starts: Sequence[int] | None = None
              ) -> list[PositionScores]:
        """Every row's PositionScores, `batch_rows` rows per request. In top-only mode the
        sampled log-prob of position j is its entry in the top-k (NaN when absent: masked and
        counted). Missing: a position without what the signal reads (its top-k entries for
        a top-k signal, else the sampled token's log-prob); `starts[r]` (the first response
        position) bounds the count to response tokens, and a share of missing ones above
        `max_missing` refuses the batch."""
        # (reading sampled log-probs from top-k dictionaries: a server found inconsistent,
        # or an openai echo that may sit one index early, asks for at least 20)
        k = self.top_k if not (self.top_only or self.protocol == "openai") \
            else max(self.top_k, 20)
        out = []
        for i in range(0, len(rows), self.batch_rows):
            out += self._request(rows[i:i + self.batch_rows], k, self.temperature)
        missing = scored = 0
        for r, (ids, ps) in enumerate(zip(rows, out)):
            lo = 1 if starts is None else max(1, int(starts[r]))
            if self.top_only:
                found = [ps.top_entry(j, int(ids[j])) for j in range(1, len(ids))]
                ps.lp = np.array([np.nan] + [np.nan if v is None else v for v in found])
            if k != self.top_k:
                ps.top_ids, ps.top_lp = ps.top_ids[:, :self.top_k], ps.top_lp[:, :self.top_k]
            # what the signal reads is missing: the top-k entries (a top-k signal) or the
            # sampled token's log-prob
            missing += int((~(ps.top_ids[lo:] >= 0).any(-1)).sum() if self.top_k > 0
                           else np.isnan(ps.lp[lo:]).sum())
            scored += len(ids) - lo
        self.stats["rows"] += len(rows)
        self.stats["missing"] += missing
        self.stats["scored"] += scored
        if scored and missing / scored > self.max_missing:
            what, fix = (("top-k entries", "the server left them out") if self.top_k > 0 else
                         ("sampled-token log-prob", "the server's top-k does not hold them "
                          "(raise top_k, or fix the server)"))
            raise ServedTeacherError(
                f"teacher server {self.url}: {missing} of {scored} response tokens have no "
                f"{what} ({missing / scored:.1%} > max_missing {self.max_missing:.0%}); "
                f"{fix}")
        return out
