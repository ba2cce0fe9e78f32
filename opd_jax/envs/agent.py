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

Per-turn thinking (effort "think_mixed"): every assistant turn has its own mode from the
task's schedule (`base.turn_mode`); the observation that opens a turn carries its mode token,
"<|tool|>7<|think_off|><|assistant|>" (student role; the prompt carries turn 0's). A
think_off turn must not think and a think_on turn must think (`parsing.mode_violation`);
an episode with a disobeyed turn scores 0 (info["mode_violations"] says which), and the
think_on turns' thinking together stays within the effort's budget (64).

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
                               register_env, register_family, render_prompt, turn_control,
                               turn_mode, turn_modes)

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
        self.task, self.turns, self.think_tokens, self.role = task, 0, 0, role
        self.modes = turn_modes(task)          # None: thinking switched per prompt
        self.violations: list[str] = []        # per-turn mode violations, "turn t: why"
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
        if self.modes is not None:
            info.update(turn_modes=list(self.modes[:self.turns]),
                        mode_violations=list(self.violations))
        self.task = None
        return StepResult("", score, True, info)

    def step(self, assistant_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset() or after done: call env.reset(task)")
        turn, self.turns = self.turns, self.turns + 1
        i = assistant_text.find(parsing.TOOL_OPEN)
        before = assistant_text if i < 0 else assistant_text[:i]
        parsed = parsing.parse_response(before)
        if parsed.error:
            return self._done(0.0, {"error": parsed.error, "correct": 0.0})
        self.think_tokens += parsing.count_tokens(parsed.think)
        if self.modes is not None:
            why = parsing.mode_violation(parsed, turn_mode(self.task, turn))
            if why:
                self.violations.append(f"turn {turn}: {why}")
        spec = effort_spec(self.task)
        if i >= 0:  # a tool call; text after </tool_call> is ignored (the sampler stops)
            j = assistant_text.find(parsing.TOOL_CLOSE, i)
            call = assistant_text[i + len(parsing.TOOL_OPEN):j if j >= 0 else None]
            self.n_calls += 1
            result = self._tool(call)
            self.n_invalid += result.startswith("error")
            if self.turns >= self._limit:
                return self._done(0.0, {"error": "max_turns", "correct": 0.0})
            control = turn_control(self.task, self.turns, self.role)  # the next turn's mode
            return StepResult(f"<|tool|>{result}{control}<|assistant|>", 0.0, False,
                              {"tool_result": result})
        pred = parsing.strip_answer_prefix(parsed.answer)
        ref = self.task.reference
        right = pred == str(ref["answer"]) or (
            re.fullmatch(r"[+-]?\d+", pred or "x") is not None and int(pred) == int(
                ref["answer"]))
        missing = sorted(set(ref["table"]) - self.looked_up) if self.require_lookups else []
        correct = float(right and not missing)
        s, eff = parsing.apply_effort(correct, self.think_tokens, spec)
        if self.violations:       # a turn disobeyed its thinking mode: like over budget
            s = 0.0
        return self._done(s, {"correct": correct, "pred": pred[:32], "missing": missing,
                              **eff})


def _thinks(task: Task, turn: int) -> bool:
    """Turn `turn` of a per-turn task is think_on (False for per-prompt tasks)."""
    return turn_modes(task) is not None and turn_mode(task, turn).think_budget > 0


def _note(task: Task, turn: int, note: str) -> str:
    """A demo turn's thinking under a per-turn schedule: "<think>note</think>" when turn
    `turn` is think_on, "" when think_off or when the task is switched per prompt."""
    return f"{parsing.THINK_OPEN}{note}{parsing.THINK_CLOSE}" if _thinks(task, turn) else ""


def _lookups(task: Task, env: ToolEnv) -> str:
    """The demo's lookup turns (each noting the name it looks up on a think_on turn)."""
    text = ""
    for turn, name in enumerate(re.findall(r"[a-z]+", task.reference["expr"])):
        call = f"{_note(task, turn, name)}{parsing.TOOL_OPEN}lookup {name}{parsing.TOOL_CLOSE}"
        text += call + env.step(call).observation
    return text


def tool_demo(task: Task) -> str:
    """A correct episode after the prompt: lookups, then think (or calc) and the answer.
    Per-turn tasks think exactly on their think_on turns."""
    env = ToolEnv()
    env.reset(task)
    table, expr, ans = task.reference["table"], task.reference["expr"], task.reference["answer"]
    text = _lookups(task, env)
    think = f"{_substitute(expr, table)}={ans}"
    turn, left = env.turns, effort_spec(task).think_budget - env.think_tokens
    mixed = turn_modes(task) is not None
    if parsing.count_tokens(think) <= left and (not mixed or _thinks(task, turn)):
        return text + f"{parsing.THINK_OPEN}{think}{parsing.THINK_CLOSE}{ans}"
    call = (f"{_note(task, turn, 'calc')}{parsing.TOOL_OPEN}calc {_substitute(expr, table)}"
            f"{parsing.TOOL_CLOSE}")
    return text + call + env.step(call).observation + _note(task, turn + 1, ans) + ans


def chain_demo(task: Task) -> str:
    """A correct tool_chain episode: every lookup, then the scratchpad that fits the budget
    (per-turn tasks: the answer alone on a think_off last turn)."""
    env = ToolEnv()
    env.reset(task)
    text = _lookups(task, env)
    budget = effort_spec(task).think_budget - env.think_tokens
    if turn_modes(task) is not None and not _thinks(task, env.turns):
        budget = 0
    return text + parsing.fit_scratchpad(task.reference["forms"], task.reference["answer"],
                                         budget)


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
