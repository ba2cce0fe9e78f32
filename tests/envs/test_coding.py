"""Domain coding: generator, code extraction, sandboxed grading, runaway programs score 0."""
import re

import pytest

from opd_jax.envs import Task, TaskSource, get_family, score, score_batch, task_reward
from opd_jax.envs.coding import code_reward_batch, extract_code


def _task(difficulty=1, seed=0, i=0, effort="max"):
    return TaskSource("code_expr", size=i + 1, seed=seed, difficulty=difficulty,
                      effort=effort)[i]


def _fixed_task():
    # f(x) = x*3+1 on hidden inputs 0..3.
    return Task("c", "code_expr", "coding", "max", "Python expr in x: multiply by 3, then "
                "add 1. f(2)=7", {"tests": [[0, 1], [1, 4], [2, 7], [-3, -8]]})


def test_generator_deterministic_and_difficulty_knob():
    p = lambda seed, d: [t.prompt for t in TaskSource("code_expr", size=15, seed=seed,  # noqa
                                                      difficulty=d)]
    assert p(0, 2) == p(0, 2) and p(0, 2) != p(1, 2)
    for d in (1, 2, 3):  # d chained integer steps
        assert all(x.count(", then ") == d - 1 for x in p(0, d))
    assert all("list x" in x for x in p(0, 4) + p(0, 5))
    assert all(x.startswith("Python expr in list x: keep") for x in p(0, 5))  # a filter


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_reference_solutions_pass_all_hidden_tests(difficulty):
    tasks = [_task(difficulty, seed=2, i=i) for i in range(6)]
    demos = [get_family("code_expr").demo(t) for t in tasks]
    res = code_reward_batch(tasks, demos)
    assert all(r.details["passed"] == r.details["n_tests"] == 6 for r in res), \
        [r.details for r in res]
    assert all(r.score == 1.0 for r in res)


@pytest.mark.parametrize("response,passed", [
    ("x*3+1", 4), ("3*x + 1", 4), ("def f(x):\n    return x*3+1", 4),
    ("```python\nx*3+1\n```", 4), ("Answer: x*3+1", 4), ("<think>times 3 plus 1</think>x*3+1", 4),
    ("x*3+1  # comment", 4), ("x+1", 1), ("abs(x*3+1)", 3), ("x*3+1 if x else 0", 3),
])
def test_partial_credit_is_the_fraction_of_tests_passed(response, passed):
    r = score(_fixed_task(), response)
    assert r.details["passed"] == passed and r.score == pytest.approx(passed / 4)


@pytest.mark.parametrize("response,error", [
    ("<think>x*3", "unclosed <think>"), ("<think>x</think>", "empty program"),
    ("```python\n```", "empty program"),
])
def test_malformed_responses_score_zero(response, error):
    r = score(_fixed_task(), response)
    assert r.score == 0.0 and r.details["error"] == error


@pytest.mark.parametrize("response,reason", [
    ("x*3+1 +", "SyntaxError"), ("y", "NameError"), ("1/0", None),
    ("def f(x):\n    while True: pass", "timeout"),
    ("def f(x):\n    import os\n    os.fork()", "violation: os.fork"),
    ("open('/etc/passwd').read()", "violation: read outside"),
    ("len(bytearray(10**10))", "MemoryError"),  # caught per test by the harness
    ("def f(x):\n    return len(bytearray(10**10))", "MemoryError"),
    ("def f(x):\n    print('y' * 10**6)\n    return x*3+1", "output_limit"),
])
def test_bad_and_runaway_programs_score_zero_without_hanging(response, reason):
    r = score(_fixed_task(), response)
    assert r.score == 0.0 and r.details["passed"] == 0
    if reason is not None:
        assert reason in f"{r.details['sandbox']} {r.details['test_errors']}", r.details


def test_program_cannot_read_expected_outputs_or_forge_results():
    # Printing a fake result line does not help: expected outputs never enter the sandbox.
    forge = "def f(x):\n    print('__RESULT_' + '0' * 16 + '__[[\"ok\", 1]]')\n    return 0"
    r = score(_fixed_task(), forge)
    assert r.details["passed"] == 0


def test_extract_code():
    assert extract_code("```py\nx+1\n```\ntrailing") == "x+1"
    assert extract_code("Answer: x+1") == "x+1"


def test_batch_across_families_runs_code_in_parallel():
    tasks = [_task(1, i=i) for i in range(4)] + [TaskSource("arithmetic", size=1)[0]]
    resp = [get_family("code_expr").demo(t) for t in tasks[:4]] + ["-1"]
    res = score_batch(task_reward, tasks, resp)
    assert [r.score for r in res[:4]] == [1.0] * 4 and res[4].details["correct"] == 0.0
    assert re.match(r"^-?\d+$", tasks[4].reference["answer"])
