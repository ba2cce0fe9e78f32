"""Domain general: generators (determinism, difficulty), verifier (right, wrong, malformed),
math-verify answers, and the effort adjustment."""
import re

import pytest

from opd_jax.envs import KNOWN_EFFORTS, EffortSpec, Task, TaskSource, get_family, score
from opd_jax.envs.general import math_equal


def _prompts(family, seed, difficulty, n=20):
    return [t.prompt for t in TaskSource(family, size=n, seed=seed, difficulty=difficulty)]


@pytest.mark.parametrize("family", ["arithmetic", "algebra"])
def test_generator_is_deterministic_per_seed(family):
    assert _prompts(family, 0, 3) == _prompts(family, 0, 3)
    assert _prompts(family, 0, 3) != _prompts(family, 1, 3)
    src = TaskSource(family, size=50, seed=4, difficulty=2)
    # Random access in any order gives the same task as sequential reading.
    assert src[37] == list(src)[37] and src[-1] == src[49]


def test_arithmetic_difficulty_knob_grows_operands_and_digits():
    for d, (n_ops, digits) in {1: (2, 1), 3: (2, 3), 4: (3, 3), 5: (3, 4)}.items():
        for p in _prompts("arithmetic", 0, d):
            nums = re.findall(r"\d+", p)
            assert len(nums) == n_ops, p
            assert max(len(x) for x in nums) == digits, p


def test_algebra_difficulty_knob_changes_equation_shape():
    assert all(re.match(r"^x[+-]\d+=-?\d+, x=\?$", p) for p in _prompts("algebra", 0, 1))
    assert all(p.count("x") == 3 for p in _prompts("algebra", 0, 4))  # x on both sides


@pytest.mark.parametrize("family", ["arithmetic", "algebra"])
@pytest.mark.parametrize("difficulty", [1, 3, 5])
def test_reference_answers_are_right(family, difficulty):
    for t in TaskSource(family, size=30, seed=7, difficulty=difficulty):
        ans = int(t.reference["answer"])
        if family == "arithmetic":
            assert eval(t.prompt[:-2]) == ans, t.prompt
        else:
            lhs, rhs = t.prompt.split(", ")[0].split("=")
            sub = lambda s: eval(re.sub(r"(\d)x", r"\1*x", s), {"x": ans})  # noqa: E731
            assert sub(lhs) == sub(rhs), t.prompt
        assert score(t, get_family(family).demo(t)).details["correct"] == 1.0


def _task(answer="42", effort="high", **meta):
    return Task("t", "arithmetic", "general", effort, "40+2=?", {"answer": answer}, meta=meta)


@pytest.mark.parametrize("response,expected", [
    ("42", 1.0), ("Answer: 42", 1.0), ("  42 <eos>", 1.0), ("+42", 1.0), ("<think></think>42", 1.0),
    ("41", 0.0), ("-42", 0.0), ("42 43", 0.0), ("forty-two", 0.0),
])
def test_verifier_right_and_wrong(response, expected):
    r = score(_task(), response)
    assert r.score == expected and r.details["correct"] == expected


@pytest.mark.parametrize("response,error", [
    ("<think>40+2=42", "unclosed <think>"), ("42</think>42", "</think> without <think>"),
    ("<think>a<think>b</think></think>42", "nested <think>"), ("<think>42</think>", "empty answer"),
    ("", "empty answer"),
])
def test_verifier_malformed_scores_zero_with_reason(response, error):
    r = score(_task(), response)
    assert r.score == 0.0 and r.details["error"] == error


def test_effort_length_penalty_and_budget():
    think = "<think>" + "x" * 8 + "</think>42"
    low, high, mx = (score(_task(effort=e), think).score for e in ("low", "high", "max"))
    b = {e: KNOWN_EFFORTS[e].think_budget for e in ("low", "high")}
    assert low == pytest.approx(1 - 0.5 * 8 / b["low"])
    assert high == pytest.approx(1 - 0.2 * 8 / b["high"])
    assert mx == 1.0
    over = score(_task(effort="low"), "<think>" + "x" * (b["low"] + 1) + "</think>42")
    assert over.score == 0.0 and over.details["over_budget"] and over.details["correct"] == 1
    # A per-cell override travels in the task's meta.
    spec = EffortSpec("low", "<|low|>", think_budget=100, length_penalty=0.0)
    t = _task().with_effort(spec)
    assert score(t, "<think>" + "x" * (b["low"] + 1) + "</think>42").score == 1.0


def test_difficulty_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="difficulty=6"):
        TaskSource("arithmetic", size=3, difficulty=6)
    with pytest.raises(ValueError, match="has no generator"):
        TaskSource("math_answer", size=3)


@pytest.mark.parametrize("pred,gold,same", [
    ("0.5", "\\frac{1}{2}", True), ("$\\frac{3}{4}$", "0.75", True), ("\\sqrt{4}", "2", True),
    ("x = 5", "5", True), ("0.5", "\\frac{1}{3}", False), ("7", "-7", False),
])
def test_math_verify_answers(pred, gold, same):
    assert math_equal(pred, gold) is same


def test_math_answer_family_scores_user_tasks():
    t = Task("m1", "math_answer", "general", "max", "Half of one?", {"answer": "\\frac{1}{2}"})
    assert score(t, "<think>1/2</think>0.5").score == 1.0
    assert score(t, "<think>1/2</think>0.6").score == 0.0
    with pytest.raises(ValueError, match="no 'answer'"):
        score(Task("m2", "math_answer", "general", "max", "?", {}), "1")
