"""Domain `coding`: trace a Python program, or write one run against hidden tests.

Families:
  code_trace  "x=7;x+=3;x*=2;x%=9;print(x)"  -> "2" (Python's own % and // on negatives).
              Difficulty 1..5 = 3, 5, 8, 11, 14 statements; the testbed family: a correct
              answer needs the value after each statement, so the think budget binds.
              Scored by exact match, no sandbox needed.
  code_expr   below (a few dozen programs at difficulty 1: not evaluated by the presets).

Prompt: "Python expr in x: multiply by 3, then add 1. f(2)=7"
Response: "<think>x*3 then +1</think>x*3+1"  (or "def f(x): return x*3+1", ``` fences ok)

The answer is wrapped as `f = lambda x: (EXPR)` (or exec'd when it starts with "def") and
called on the task's hidden inputs inside `sandbox.run_python`; reward = fraction of hidden
tests passed, effort-adjusted. Expected outputs never enter the sandbox, so a program can
only score by computing them. Difficulty 1..3 chains 1..3 integer steps; 4 maps over a
list and reduces it; 5 adds a filter.
"""
from __future__ import annotations

import json
import re
import secrets

from opd_jax.envs import parsing, sandbox
from opd_jax.envs.base import RewardResult, Task, TaskFamily, effort_spec, register_family
from opd_jax.envs.general import exact_answer_reward, forms_demo

# difficulty -> number of statements after the assignment
TRACE_LEVELS = {1: 3, 2: 5, 3: 8, 4: 11, 5: 14}
# (operator, operand range), repeated by weight: + and - most, then *, then % and //
TRACE_OPS = ((("+", (1, 9)),) * 3 + (("-", (1, 9)),) * 3 + (("*", (2, 3)),) * 2 +
             (("%", (4, 9)), ("//", (2, 3))))
TRACE_BOUND = 99   # |x| stays within it (a statement that would leave it is redrawn)


def gen_code_trace(rng, difficulty: int) -> tuple[str, dict]:
    """Straight-line Python on one int; reference["forms"] are the trace's scratchpads."""
    if difficulty not in TRACE_LEVELS:
        raise ValueError(f"code_trace: difficulty={difficulty!r}, expected one of "
                         f"{sorted(TRACE_LEVELS)}")
    x0 = x = rng.randint(0, 9)
    stmts, ops = [f"x={x0}"], []
    while len(ops) < TRACE_LEVELS[difficulty]:
        op, (lo, hi) = rng.choice(TRACE_OPS)
        k = rng.randint(lo, hi)
        new = {"+": x + k, "-": x - k, "*": x * k, "%": x % k, "//": x // k}[op]
        if abs(new) > TRACE_BOUND:
            continue
        stmts.append(f"x{op}={k}")
        ops.append((op, k, new))
        x = new
    prompt = ";".join(stmts) + ";print(x)"
    return prompt, {"answer": str(x), "forms": parsing.chain_forms(x0, ops)}

N_TESTS = 6
INT_OPS = (  # (description, code with {p} = previous expression, k range)
    ("add {k}", "{p}+{k}", (1, 9)),
    ("subtract {k}", "{p}-{k}", (1, 9)),
    ("multiply by {k}", "{p}*{k}", (2, 5)),
    ("mod {k}", "{p}%{k}", (2, 9)),
    ("floor-divide by {k}", "{p}//{k}", (2, 5)),
    ("square", "{p}*{p}", None),
    ("negate", "-{p}", None),
)
REDUCERS = (("sum", "sum({g})"), ("max (0 if empty)", "max({g},default=0)"),
            ("min (0 if empty)", "min({g},default=0)"), ("count", "len([{g}])"),
            ("sort", "sorted({g})"))
FILTERS = (("keep items > {k}", "v>{k}"), ("keep even items", "v%2==0"),
           ("keep odd items", "v%2==1"), ("keep items < {k}", "v<{k}"))


def _wrap(p: str) -> str:
    return p if re.fullmatch(r"\w+", p) else f"({p})"


def _chain(rng, n: int, var: str) -> tuple[list[str], list[str]]:
    """n integer steps on `var`: their descriptions and the code after each step."""
    words, codes = [], []
    for _ in range(n):
        desc, tmpl, kr = rng.choice(INT_OPS)
        k = rng.randint(*kr) if kr else 0
        words.append(desc.format(k=k))
        codes.append(tmpl.format(p=_wrap(codes[-1] if codes else var), k=k))
    return words, codes


def _eval_ref(code: str, x):
    # Our own generated code over ints/lists: safe to evaluate in-process.
    return eval(f"lambda x: ({code})", {"__builtins__": {"sum": sum, "max": max, "min": min,
                                                         "len": len, "sorted": sorted}})(x)


def gen_code_expr(rng, difficulty: int) -> tuple[str, dict]:
    if not 1 <= difficulty <= 5:
        raise ValueError(f"code_expr: difficulty={difficulty!r}, expected 1..5")
    if difficulty <= 3:
        words, partials = _chain(rng, difficulty, "x")
        code = partials[-1]
        spec = "Python expr in x: " + ", then ".join(words)
        inputs = [rng.randint(-20, 20) for _ in range(N_TESTS + 1)]
    else:
        words, partials = _chain(rng, 1, "v")
        item = partials[-1]
        rdesc, rtmpl = rng.choice(REDUCERS)
        cond = ""
        if difficulty == 5:
            fdesc, ftmpl = rng.choice(FILTERS)
            k = rng.randint(0, 5)
            words.insert(0, fdesc.format(k=k))
            cond = " if " + ftmpl.format(k=k)
        words = [w if i == 0 and difficulty == 5 else f"{w} each" for i, w in
                 enumerate(words)]
        code = rtmpl.format(g=f"{item} for v in x{cond}")
        if rtmpl.startswith(("sum", "max", "min")):
            code = rtmpl.format(g=f"[{item} for v in x{cond}]")
        spec = "Python expr in list x: " + ", then ".join(words + [rdesc])
        partials.append(code)
        inputs = [[rng.randint(-9, 9) for _ in range(rng.randint(0, 5))]
                  for _ in range(N_TESTS + 1)]
    ex_in, *hidden = inputs
    prompt = f"{spec}. f({json.dumps(ex_in, separators=(',', ':'))})={_eval_ref(code, ex_in)}"
    tests = [[x, _eval_ref(code, x)] for x in hidden]
    # steps: the program as it grows, one operation at a time (the demo's thinking).
    return prompt, {"solution": code, "tests": tests, "steps": partials[:-1]}


HARNESS = '''import json, sys
SOLUTION = {solution!r}
ns = {{}}
if SOLUTION.lstrip().startswith("def "):
    exec(compile(SOLUTION, "solution", "exec"), ns)
    f = ns.get("f")
else:
    f = eval(compile("lambda x: (" + SOLUTION + "\\n)", "solution", "eval"), ns)
out = []
for x in json.loads(sys.stdin.read()):
    try:
        v = f(x)
        json.dumps(v)
        out.append(["ok", v])
    except Exception as e:
        out.append(["err", type(e).__name__])
sys.stdout.write("\\n{mark}" + json.dumps(out) + "\\n")
'''
_FENCE_RE = re.compile(r"```(?:python|py)?\s*\n?(.*?)```", re.DOTALL)


def extract_code(answer: str) -> str:
    """The program in a final answer: a fenced block if there is one, else the text."""
    m = _FENCE_RE.search(answer)
    return (m.group(1) if m else parsing.strip_answer_prefix(answer)).strip()


def _prepare(task: Task, response: str):
    if "tests" not in task.reference:
        raise ValueError(f"task {task.id!r}: code task needs reference['tests']")
    parsed = parsing.parse_response(response)
    code = extract_code(parsed.answer) if parsed.error is None else ""
    if parsed.error is None and not code:
        parsed = parsing.Parsed(parsed.think, "", parsed.n_think_blocks, "empty program")
    return parsed, code


def _grade(task: Task, parsed, code: str, res, mark: str) -> RewardResult:
    tests = task.reference["tests"]
    line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(mark)), None)
    passed, err, test_errors = 0, res.reason, []
    if line is not None:
        outs = json.loads(line[len(mark):])
        passed = sum(o[0] == "ok" and o[1] == want for o, (_, want) in zip(outs, tests))
        test_errors = sorted({o[1] for o in outs if o[0] == "err"})
    elif err is None:
        err = (res.stderr.strip().splitlines() or ["no output"])[-1][:120]
    frac = passed / len(tests)
    s, details = parsing.verified_reward(parsed, frac, effort_spec(task), passed=passed,
                                         n_tests=len(tests), sandbox=err, test_errors=test_errors,
                                         code=code[:120])
    return RewardResult(s, details)


def code_reward_batch(tasks: list[Task], responses: list[str], *, timeout_s: float = 2.0,
                      memory_mb: int = 256, max_workers: int | None = None
                      ) -> list[RewardResult]:
    """Score many code responses, running their programs in parallel sandboxes."""
    if len(tasks) != len(responses):
        raise ValueError(f"len(tasks)={len(tasks)} != len(responses)={len(responses)}")
    prepared = [_prepare(t, r) for t, r in zip(tasks, responses)]
    mark = f"__RESULT_{secrets.token_hex(8)}__"
    todo = [i for i, (p, c) in enumerate(prepared) if p.error is None]
    codes = [HARNESS.format(solution=prepared[i][1], mark=mark) for i in todo]
    stdins = [json.dumps([x for x, _ in tasks[i].reference["tests"]]) for i in todo]
    results = sandbox.run_many(codes, stdins=stdins, max_workers=max_workers,
                               timeout_s=timeout_s, memory_mb=memory_mb,
                               max_output_bytes=64 << 10)
    by_index = dict(zip(todo, results))
    out = []
    for i, (t, (parsed, code)) in enumerate(zip(tasks, prepared)):
        if parsed.error is not None:
            out.append(RewardResult(*parsing.verified_reward(parsed, 0.0, effort_spec(t))))
        else:
            out.append(_grade(t, parsed, code, by_index[i], mark))
    return out


def code_reward(task: Task, response: str) -> RewardResult:
    return code_reward_batch([task], [response])[0]


def code_demo(task: Task) -> str:
    think = ";".join(task.reference.get("steps", []))
    sol = task.reference["solution"]
    if think and parsing.count_tokens(think) <= effort_spec(task).think_budget:
        return f"{parsing.THINK_OPEN}{think}{parsing.THINK_CLOSE}{sol}"
    return sol


CODE_TRACE = register_family(TaskFamily("code_trace", "coding", gen_code_trace,
                                        exact_answer_reward, demo=forms_demo))
CODE_EXPR = register_family(TaskFamily(
    "code_expr", "coding", gen_code_expr, code_reward, demo=code_demo,
    reward_batch=code_reward_batch,
    # one problem per program: the same program with another example input is not new
    canonical=lambda prompt, ref: ref["solution"]))
