"""Reading responses: think spans, final answers, token counts, and the effort adjustment.

A response looks like "<think>12+30=42</think>42" (thinking optional). The final answer is
the text after the last </think>; an unclosed or nested <think> is malformed. Tokens are
counted the way the char-level tokenizer splits text: one per special token, one per other
character (pass `count_fn` to use a real tokenizer's length instead).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from opd_jax.envs.base import EffortSpec

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = (
    "<pad>", "<bos>", "<eos>", "<unk>", "<think>", "</think>", "<|low|>", "<|high|>",
    "<|max|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>",
    "<|think_on|>", "<|think_off|>",
)
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
# Trailing tokens a sampler may leave on a response; they are not part of the answer.
_TRAILING_RE = re.compile(r"(?:\s|<eos>|<pad>)+$")
_ANSWER_PREFIX_RE = re.compile(r"^\s*(?:final\s+)?answer\s*[:=]\s*", re.IGNORECASE)


def count_tokens(text: str) -> int:
    """Char-level token count: "<think>ab</think>" -> 4."""
    n_special = len(_SPECIAL_RE.findall(text))
    return len(_SPECIAL_RE.sub("", text)) + n_special


@dataclasses.dataclass(frozen=True)
class Parsed:
    """think: the text inside think spans (joined); answer: the text after the last one."""
    think: str
    answer: str
    n_think_blocks: int
    error: str | None = None
    stray_text: bool = False  # non-space text before/between think spans


def parse_response(text: str) -> Parsed:
    """Split a response into thinking and final answer; `error` names a malformed shape.

    >>> parse_response("<think>2+2=4</think>Answer: 4").answer
    'Answer: 4'
    """
    if not isinstance(text, str):
        return Parsed("", "", 0, f"response is {type(text).__name__}, expected str")
    text = _TRAILING_RE.sub("", text)
    thinks, outside, pos, depth_err = [], [], 0, None
    while True:
        i = text.find(THINK_OPEN, pos)
        j = text.find(THINK_CLOSE, pos)
        if i < 0 and j < 0:
            break
        if j >= 0 and (i < 0 or j < i):
            depth_err = "</think> without <think>"
            break
        k = text.find(THINK_CLOSE, i + len(THINK_OPEN))
        if k < 0:
            depth_err = "unclosed <think>"
            break
        inner = text[i + len(THINK_OPEN):k]
        if THINK_OPEN in inner:
            depth_err = "nested <think>"
            break
        outside.append(text[pos:i])
        thinks.append(inner)
        pos = k + len(THINK_CLOSE)
    answer = text[pos:].strip()
    if depth_err:
        return Parsed("".join(thinks), "", len(thinks), depth_err)
    stray = any(s.strip() for s in outside)
    return Parsed("".join(thinks), answer, len(thinks), None, stray)


def strip_answer_prefix(answer: str) -> str:
    """ "Answer: 42" -> "42"; a leading "Final answer =" works too."""
    return _ANSWER_PREFIX_RE.sub("", answer, count=1).strip()


def apply_effort(correct: float, think_tokens: int, spec: EffortSpec) -> tuple[float, dict]:
    """Effort-adjusted reward: 0 over budget, else correct * (1 - pen * used / budget).

    >>> apply_effort(1.0, 8, EffortSpec("low", "<|low|>", 16, 0.5))[0]
    0.75
    """
    over = think_tokens > spec.think_budget
    if over:
        s = 0.0
    elif spec.think_budget == 0:
        s = float(correct)
    else:
        s = float(correct) * (1.0 - spec.length_penalty * think_tokens / spec.think_budget)
    return s, {"think_tokens": think_tokens, "think_budget": spec.think_budget,
               "over_budget": over, "effort": spec.name}


def mode_violation(parsed: Parsed, mode: EffortSpec,
                   count_fn: Callable[[str], int] = count_tokens) -> str | None:
    """Why one assistant turn disobeys its per-turn thinking mode, or None if it obeys.

    A mode with budget 0 (think_off) must not think (an empty "<think></think>", what the
    sampler's forced close leaves, is no thinking); any other (think_on) must think (a think
    span with at least one token).

    >>> mode_violation(parse_response("<think>7+3</think>10"),
    ...                EffortSpec("think_off", "<|think_off|>", 0, 0.0))
    'thought in a think_off turn'
    """
    used = count_fn(parsed.think)
    if mode.think_budget == 0:
        return "thought in a think_off turn" if used > 0 else None
    return None if used > 0 else "no thinking in a think_on turn"


def verified_reward(parsed: Parsed, correct: float, spec: EffortSpec,
                    count_fn: Callable[[str], int] = count_tokens, **details) -> tuple:
    """(score, details) for a parsed single-turn response that a verifier marked `correct`."""
    if parsed.error:
        return 0.0, {"error": parsed.error, "correct": 0.0, **details}
    s, eff = apply_effort(correct, count_fn(parsed.think), spec)
    return s, {"correct": float(correct), **eff, **details}


def chain_forms(start: int, ops: list[tuple[str, int, int]]) -> list[str]:
    """Scratchpads of a left-to-right computation, most detailed first.

    ops are (operator, operand, result) in order, starting from `start`. Forms: every step
    written out ("7+3=10;10-4=6"), then the running results only ("10,6"), then every 2nd,
    3rd, ... result (the last always kept: it is the answer). Longer forms are easier for a
    model (each step is local); shorter ones fit smaller think budgets.
    """
    full, prev = [], start
    for op, v, new in ops:
        full.append(f"{prev}{op}{v}={new}")
        prev = new
    totals = [str(new) for _, _, new in ops]
    forms = [";".join(full), ",".join(totals)]
    for stride in range(2, len(totals) + 1):
        idx = list(range(stride - 1, len(totals), stride))
        if idx[-1] != len(totals) - 1:
            idx.append(len(totals) - 1)
        forms.append(",".join(totals[i] for i in idx))
    return forms


def fit_scratchpad(forms: list[str], answer: str, budget: int) -> str:
    """The response with the most detailed scratchpad that fits `budget` think tokens.

    >>> fit_scratchpad(["7+3=10;10-4=6", "10,6", "6"], "6", 5)
    '<think>10,6</think>6'
    """
    for form in forms:
        if form and count_tokens(form) <= budget:
            return f"{THINK_OPEN}{form}{THINK_CLOSE}{answer}"
    return answer
