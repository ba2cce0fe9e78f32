"""Domain `general`: verifiable reasoning with exact answers.

Families:
  chain       "7+3-4+9-2=?"           difficulty 1..5 = 4, 6, 9, 12, 16 one-digit operands;
              the testbed family: a correct answer needs running totals, so the think
              budget binds (full steps ~6.5 tokens per operator, totals only ~3)
  arithmetic  "123+45-67=?"           difficulty 1..5 = operand count x digit count
              (small spaces: 100 problems at difficulty 1, 19,800 at 2: too few for a
              held-out split of 2,000; the presets do not evaluate it)
  algebra     "3x+4=19, x=?"          difficulty 1..5 = equation shape x coefficient size
              (a few thousand problems per difficulty; not evaluated by the presets)
  math_answer user-brought tasks (JSONL) whose reference["answer"] is any math answer,
              checked with the `math-verify` package ("\\frac{1}{2}" == "0.5")

A response is "<think>...</think>ANSWER"; "Answer: 42" is accepted too. Integers are
compared exactly; anything else goes through math-verify when it is installed.
"""
from __future__ import annotations

import re
import threading

from opd_jax.envs import parsing
from opd_jax.envs.base import RewardResult, Task, TaskFamily, effort_spec, register_family

_INT_RE = re.compile(r"^[+-]?\d+$")
# difficulty -> (operands, digits, ops)
ARITHMETIC_LEVELS = {1: (2, 1, "+"), 2: (2, 2, "+-"), 3: (2, 3, "+-"), 4: (3, 3, "+-"),
                     5: (3, 4, "+-")}
# difficulty -> (shape, coefficient bound): shape 1 "x+b=c", 2 "ax+b=c", 3 "ax+b=cx+d"
ALGEBRA_LEVELS = {1: (1, 9), 2: (2, 5), 3: (2, 12), 4: (3, 5), 5: (3, 12)}


def _check_level(name: str, difficulty: int, levels: dict) -> None:
    if difficulty not in levels:
        raise ValueError(f"{name}: difficulty={difficulty!r}, expected one of "
                         f"{sorted(levels)}")


def gen_arithmetic(rng, difficulty: int) -> tuple[str, dict]:
    """Left-to-right +/- chain. Steps are the running totals, one per operator."""
    _check_level("arithmetic", difficulty, ARITHMETIC_LEVELS)
    n_ops, digits, ops = ARITHMETIC_LEVELS[difficulty]
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
    nums = [rng.randint(lo, hi) for _ in range(n_ops)]
    signs = [rng.choice(ops) for _ in range(n_ops - 1)]
    expr, total, steps = str(nums[0]), nums[0], []
    for s, v in zip(signs, nums[1:]):
        new = total + v if s == "+" else total - v
        steps.append(f"{total}{s}{v}={new}")
        expr, total = expr + s + str(v), new
    return f"{expr}=?", {"answer": str(total), "steps": steps}


# difficulty -> number of one-digit operands
CHAIN_LEVELS = {1: 4, 2: 6, 3: 9, 4: 12, 5: 16}


def gen_chain(rng, difficulty: int) -> tuple[str, dict]:
    """A +/- chain of one-digit operands; reference["forms"] are its scratchpads."""
    _check_level("chain", difficulty, CHAIN_LEVELS)
    nums = [rng.randint(0, 9) for _ in range(CHAIN_LEVELS[difficulty])]
    total, expr, ops = nums[0], str(nums[0]), []
    for v in nums[1:]:
        op = rng.choice("+-")
        total = total + v if op == "+" else total - v
        ops.append((op, v, total))
        expr += f"{op}{v}"
    return f"{expr}=?", {"answer": str(total), "forms": parsing.chain_forms(nums[0], ops)}


def forms_demo(task: Task) -> str:
    """A correct response with the most detailed scratchpad the effort's budget allows."""
    return parsing.fit_scratchpad(task.reference["forms"], task.reference["answer"],
                                  effort_spec(task).think_budget)


def gen_algebra(rng, difficulty: int) -> tuple[str, dict]:
    """Linear equation in x with an integer root."""
    _check_level("algebra", difficulty, ALGEBRA_LEVELS)
    shape, bound = ALGEBRA_LEVELS[difficulty]
    x = rng.randint(-bound, bound)
    a = 1 if shape == 1 else rng.randint(2, bound)
    c = rng.randint(1, a - 1) if shape == 3 and a > 2 else (1 if shape == 3 else 0)
    b = rng.randint(-bound * 2, bound * 2)
    d = (a - c) * x + b  # ax + b = cx + d  <=>  (a-c)x = d - b
    lhs = ("x" if a == 1 else f"{a}x") + (f"+{b}" if b >= 0 else str(b))
    rhs = str(d) if c == 0 else ("x" if c == 1 else f"{c}x") + (f"+{d}" if d >= 0 else
                                                                   str(d))
    k = a - c
    kx = "x" if k == 1 else f"{k}x"
    move = f"{d}-{b}" if b >= 0 else f"{d}+{-b}"
    steps = [f"{kx}={move}={d - b}"]
    if k != 1:
        steps.append(f"x={d - b}/{k}={x}")
    return f"{lhs}={rhs}, x=?", {"answer": str(x), "steps": steps}


def math_equal(pred: str, gold: str) -> bool:
    """True when `pred` and `gold` are the same math answer (math-verify, else exact)."""
    pred, gold = pred.strip(), gold.strip()
    if _INT_RE.match(pred) and _INT_RE.match(gold):
        return int(pred) == int(gold)
    if len(pred) > 200:  # no timeout off the main thread: keep sympy's input small
        return False
    try:
        from math_verify import parse, verify   # lazy: start-up time (sympy), optional
    except ImportError:  # fallback: exact string match after stripping spaces and $
        return pred.replace(" ", "").strip("$") == gold.replace(" ", "").strip("$")
    # math-verify's timeouts use SIGALRM, which works only in the main thread.
    main = threading.current_thread() is threading.main_thread()
    t = 1 if main else None   # seconds; a policy's garbage answers hit this often
    wrap = (lambda s: s if "$" in s or "\\" not in s else f"${s}$")
    g = parse(wrap(gold), parsing_timeout=t)
    p = parse(wrap(pred), parsing_timeout=t)
    return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=t))


def exact_answer_reward(task: Task, response: str) -> RewardResult:
    """1 for the right final answer (effort-adjusted), 0 for wrong or malformed."""
    parsed = parsing.parse_response(response)
    gold = str(task.reference.get("answer", ""))
    if not gold:
        raise ValueError(f"task {task.id!r}: reference has no 'answer'")
    pred = parsing.strip_answer_prefix(parsed.answer)
    if parsed.error is None and not pred:
        parsed = parsing.Parsed(parsed.think, "", parsed.n_think_blocks, "empty answer")
    correct = float(parsed.error is None and math_equal(pred, gold))
    s, details = parsing.verified_reward(parsed, correct, effort_spec(task), pred=pred[:64])
    return RewardResult(s, details)


def steps_demo(task: Task) -> str:
    """A correct response: the worked steps as thinking if they fit the think budget."""
    steps, ans = task.reference.get("steps", []), task.reference["answer"]
    think = ";".join(steps)
    if steps and parsing.count_tokens(think) <= effort_spec(task).think_budget:
        return f"{parsing.THINK_OPEN}{think}{parsing.THINK_CLOSE}{ans}"
    return ans


CHAIN = register_family(TaskFamily("chain", "general", gen_chain, exact_answer_reward,
                                   demo=forms_demo))
ARITHMETIC = register_family(TaskFamily("arithmetic", "general", gen_arithmetic,
                                        exact_answer_reward, demo=steps_demo))
ALGEBRA = register_family(TaskFamily("algebra", "general", gen_algebra, exact_answer_reward,
                                     demo=steps_demo))
MATH_ANSWER = register_family(TaskFamily("math_answer", "general", None, exact_answer_reward,
                                         demo=steps_demo, max_difficulty=0))
