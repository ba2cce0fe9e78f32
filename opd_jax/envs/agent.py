"""Domain `agent`: multi-turn tool use. The model looks up hidden values and combines them.

Prompt: "Tools: lookup NAME, calc EXPR. kiwi+fig=?"  (values of kiwi, fig are hidden)
    assistant  "<tool_call>lookup kiwi</tool_call>"        observation "<|tool|>7<|assistant|>"
    assistant  "<tool_call>lookup fig</tool_call>"         observation "<|tool|>12<|assistant|>"
    assistant  "<think>7+12=19</think>19"                  done, reward 1.0

Each assistant turn ends at "</tool_call>" (a stop string) or at the end of the response.
A turn without a tool call is the final answer. The reward is read from the final state:
the answer must equal the expression over the hidden table and, by default, every name in
it must have been looked up (values are random per task, so guessing scores ~0 anyway).
Thinking in all turns counts against the effort's think budget. Difficulty 1..5 raises the
number of names and the size of their values.

Family `tool_chain` (the testbed family) offers only `lookup`: "Tools: lookup NAME.
kiwi+fig-plum=?" with one-digit values and 2, 3, 4, 6, 8 names at difficulty 1..5. With no
calculator the final sum needs a scratchpad over the looked-up values (notes "kiwi=7", then
running totals), so the effort's think budget binds.
"""
from __future__ import annotations

import ast
import re

from opd_jax.envs import parsing
from opd_jax.envs.base import (RewardResult, StepResult, Task, TaskFamily, effort_spec,
                               register_env, register_family, render_prompt)

NAMES = ("kiwi", "fig", "plum", "lime", "pear", "date", "yam", "corn", "bean", "leek",
         "kale", "okra", "nut", "rice", "oat", "rye", "pea", "taro", "sage", "mint")
# difficulty -> (names in the expression, max value, ops)
AGENT_LEVELS = {1: (2, 9, "+"), 2: (2, 99, "+-"), 3: (3, 9, "+-"), 4: (3, 99, "+-"),
                5: (4, 99, "+-*")}
TOOL_HEADER = "Tools: lookup NAME, calc EXPR. "
CHAIN_HEADER = "Tools: lookup NAME. "
CHAIN_NAMES = {1: 2, 2: 3, 3: 4, 4: 6, 5: 8}   # difficulty -> names in tool_chain
_CALC_RE = re.compile(r"^[0-9+\-*() ]{1,64}$")


def gen_tool_lookup(rng, difficulty: int) -> tuple[str, dict]:
    if difficulty not in AGENT_LEVELS:
        raise ValueError(f"tool_lookup: difficulty={difficulty!r}, expected one of "
                         f"{sorted(AGENT_LEVELS)}")
    k, vmax, ops = AGENT_LEVELS[difficulty]
    names = rng.sample(NAMES, k)
    table = {n: rng.randint(1, vmax) for n in names}
    # Only one "*" at most, so answers stay a few digits long.
    signs = [rng.choice(ops) for _ in range(k - 1)]
    if signs.count("*") > 1:
        signs = [s if s != "*" or i == signs.index("*") else "+" for i, s in enumerate(signs)]
    expr = names[0] + "".join(s + n for s, n in zip(signs, names[1:]))
    answer = safe_calc(_substitute(expr, table))
    return f"{TOOL_HEADER}{expr}=?", {"table": table, "expr": expr, "answer": str(answer)}


def gen_tool_chain(rng, difficulty: int) -> tuple[str, dict]:
    if difficulty not in CHAIN_NAMES:
        raise ValueError(f"tool_chain: difficulty={difficulty!r}, expected one of "
                         f"{sorted(CHAIN_NAMES)}")
    names = rng.sample(NAMES, CHAIN_NAMES[difficulty])
    table = {n: rng.randint(0, 9) for n in names}
    total, expr, ops = table[names[0]], names[0], []
    for n in names[1:]:
        op = rng.choice("+-")
        total = total + table[n] if op == "+" else total - table[n]
        ops.append((op, table[n], total))
        expr += op + n
    notes = ";".join(f"{n}={table[n]}" for n in names)
    forms = parsing.chain_forms(table[names[0]], ops)
    return (f"{CHAIN_HEADER}{expr}=?", {"table": table, "expr": expr, "answer": str(total),
                                          "tools": ["lookup"],
                                          "forms": [f"{notes};{forms[0]}", *forms]})


def _canonical(prompt: str, reference: dict) -> str:
    """A lookup problem is its prompt and its hidden table (the table decides the answer)."""
    return prompt + "|" + ",".join(f"{k}={v}" for k, v in sorted(reference["table"].items()))


def _substitute(expr: str, table: dict) -> str:
    return re.sub(r"[a-z]+", lambda m: str(table[m.group(0)]), expr)


def safe_calc(expr: str) -> int:
    """Integer + - * ( ) only; anything else raises ValueError. safe_calc("2*(3+4)") == 14."""
    if not _CALC_RE.match(expr):
        raise ValueError(f"calc: bad expression {expr[:64]!r}")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            r = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(
                node.op, ast.Sub) else a * b
            if abs(r) > 10 ** 12:
                raise ValueError("calc: result too large")
            return r
        raise ValueError(f"calc: unsupported syntax in {expr[:64]!r}")

    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(f"calc: bad expression {expr[:64]!r}") from None


class ToolEnv:
    """The tool_lookup environment; one instance per episode (make_env builds a fresh one)."""
    stop_strings = (parsing.TOOL_CLOSE,)

    def __init__(self, max_turns: int | None = None, require_lookups: bool = True):
        self.max_turns, self.require_lookups = max_turns, require_lookups
        self.task: Task | None = None

    def reset(self, task: Task, role: str = "student") -> str:
        if "table" not in task.reference or "answer" not in task.reference:
            raise ValueError(f"task {task.id!r}: tool_lookup needs reference table and "
                             f"answer, got keys {sorted(task.reference)}")
        self.task, self.turns, self.think_tokens = task, 0, 0
        self.looked_up: set[str] = set()
        self.n_calls = self.n_invalid = 0
        # Enough turns for every lookup, a calc, and the answer, plus one slip.
        self._limit = self.max_turns or len(task.reference["table"]) + 3
        return render_prompt(task, role)

    def _tool(self, call: str) -> str:
        name, _, arg = call.strip().partition(" ")
        arg = arg.strip()
        table = self.task.reference["table"]
        if name == "lookup":
            if arg in table:
                self.looked_up.add(arg)
                return str(table[arg])
            return f"error: unknown name {arg[:16]!r}"
        if name == "calc" and "calc" in self.task.reference.get("tools", ("lookup", "calc")):
            try:
                return str(safe_calc(arg))
            except ValueError as e:
                return f"error: {e}"
        return f"error: unknown tool {name[:16]!r}"

    def _done(self, score: float, info: dict) -> StepResult:
        info.update(turns=self.turns, n_calls=self.n_calls, n_invalid=self.n_invalid,
                    looked_up=sorted(self.looked_up))
        self.task = None
        return StepResult("", score, True, info)

    def step(self, assistant_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset() or after done: call env.reset(task)")
        self.turns += 1
        i = assistant_text.find(parsing.TOOL_OPEN)
        before = assistant_text if i < 0 else assistant_text[:i]
        parsed = parsing.parse_response(before)
        if parsed.error:
            return self._done(0.0, {"error": parsed.error, "correct": 0.0})
        self.think_tokens += parsing.count_tokens(parsed.think)
        spec = effort_spec(self.task)
        if i >= 0:  # a tool call; text after </tool_call> is ignored (the sampler stops)
            j = assistant_text.find(parsing.TOOL_CLOSE, i)
            call = assistant_text[i + len(parsing.TOOL_OPEN):j if j >= 0 else None]
            self.n_calls += 1
            result = self._tool(call)
            self.n_invalid += result.startswith("error")
            if self.turns >= self._limit:
                return self._done(0.0, {"error": "max_turns", "correct": 0.0})
            return StepResult(f"<|tool|>{result}<|assistant|>", 0.0, False,
                              {"tool_result": result})
        pred = parsing.strip_answer_prefix(parsed.answer)
        ref = self.task.reference
        right = pred == str(ref["answer"]) or (
            re.fullmatch(r"[+-]?\d+", pred or "x") is not None and int(pred) == int(
                ref["answer"]))
        missing = sorted(set(ref["table"]) - self.looked_up) if self.require_lookups else []
        correct = float(right and not missing)
        s, eff = parsing.apply_effort(correct, self.think_tokens, spec)
        return self._done(s, {"correct": correct, "pred": pred[:32], "missing": missing,
                              **eff})


def tool_demo(task: Task) -> str:
    """A correct episode after the prompt: lookups, then think (or calc) and the answer."""
    env = ToolEnv()
    env.reset(task)
    table, expr, ans = task.reference["table"], task.reference["expr"], task.reference["answer"]
    text = ""
    for name in re.findall(r"[a-z]+", expr):
        call = f"{parsing.TOOL_OPEN}lookup {name}{parsing.TOOL_CLOSE}"
        text += call + env.step(call).observation
    think = f"{_substitute(expr, table)}={ans}"
    if parsing.count_tokens(think) <= effort_spec(task).think_budget:
        return text + f"{parsing.THINK_OPEN}{think}{parsing.THINK_CLOSE}{ans}"
    call = f"{parsing.TOOL_OPEN}calc {_substitute(expr, table)}{parsing.TOOL_CLOSE}"
    return text + call + env.step(call).observation + ans


def chain_demo(task: Task) -> str:
    """A correct tool_chain episode: every lookup, then the scratchpad that fits the budget."""
    env = ToolEnv()
    env.reset(task)
    text = ""
    for name in re.findall(r"[a-z]+", task.reference["expr"]):
        call = f"{parsing.TOOL_OPEN}lookup {name}{parsing.TOOL_CLOSE}"
        text += call + env.step(call).observation
    return text + parsing.fit_scratchpad(task.reference["forms"], task.reference["answer"],
                                         effort_spec(task).think_budget)


def split_turns(transcript: str) -> list[str]:
    """Assistant turns of a transcript (observations "<|tool|>...<|assistant|>" removed)."""
    turns = re.split(r"<\|tool\|>.*?<\|assistant\|>", transcript, flags=re.DOTALL)
    return [t for t in turns if t] or [""]


def run_episode(task: Task, turns: list[str]) -> RewardResult:
    """Replay assistant turns through a fresh env; the reward of the last step, as a
    RewardResult. A transcript that stops before a final answer scores 0."""
    env = ToolEnv()
    env.reset(task)
    res = None
    for t in turns:
        res = env.step(t)
        if res.done:
            return RewardResult(res.reward, res.info)
    return RewardResult(0.0, {"error": "episode did not finish", "correct": 0.0})


def transcript_reward(task: Task, response: str) -> RewardResult:
    """Reward of a whole episode given as one transcript (turns and observations)."""
    return run_episode(task, split_turns(response))


register_env("tool_lookup", ToolEnv)
TOOL_LOOKUP = register_family(TaskFamily("tool_lookup", "agent", gen_tool_lookup,
                                         transcript_reward, env="tool_lookup",
                                         demo=tool_demo, canonical=_canonical))
TOOL_CHAIN = register_family(TaskFamily("tool_chain", "agent", gen_tool_chain,
                                        transcript_reward, env="tool_lookup",
                                        demo=chain_demo, canonical=_canonical))
