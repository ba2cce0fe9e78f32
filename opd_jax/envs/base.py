"""The environment protocol the rollout engine consumes: tasks, efforts, rewards, registries.

Text level only; the rollout driver tokenizes. A `Task` is one prompt with its (domain,
effort) cell and hidden reference data; a *family* generates tasks of one kind and scores
responses to them; an `Environment` turns a task into turns:

    env = make_env(task)
    obs = env.reset(task)                  # rendered prompt, ends with "<|assistant|>"
    while True:
        text = generate(context + obs, stop=env.stop_strings)
        res = env.step(text)               # StepResult(observation, reward, done, info)
        if res.done: break
        obs = res.observation              # e.g. "<|tool|>7<|assistant|>"

Single-turn tasks use `SingleTurnEnv` (one step, done). The student prompt starts with the
effort control token (`<|low|>`...); the teacher prompt omits it (`render_prompt(role=...)`).

Thinking switched per assistant turn (effort "think_mixed", multi-turn tasks only): the task
carries its schedule, `meta["turn_modes"]` (one THINKING_MODES name per turn); turn t obeys
`turn_mode(task, t)`. The prompt carries turn 0's mode token, and the observation that opens
turn t carries turn t's ("<|tool|>7<|think_off|><|assistant|>").
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Protocol, runtime_checkable

DOMAINS = ("general", "agent", "coding")
ROLES = ("student", "teacher")
# Every procedural problem belongs to exactly one split, fixed by a hash of its canonical
# form (envs.data.split_of): trainers draw only "train", every evaluation only "eval".
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class EffortSpec:
    """One reasoning effort: its prompt control token, think budget, and length penalty.

    think_budget: tokens allowed between <think> and </think> (over budget scores 0); None:
      the effort does not govern thinking (a chat model's own format: no span is forced).
    length_penalty: a correct answer scores 1 - length_penalty * think_tokens / think_budget.
    """
    name: str
    control_token: str
    think_budget: int | None
    length_penalty: float

    def __post_init__(self):
        if self.think_budget is not None and self.think_budget < 0:
            raise ValueError(f"think_budget={self.think_budget} for effort {self.name!r}: "
                             f"expected >= 0")
        if not 0.0 <= self.length_penalty <= 1.0:
            raise ValueError(f"length_penalty={self.length_penalty} for effort "
                             f"{self.name!r}: expected in [0, 1]")


DEFAULT_EFFORTS: dict[str, EffortSpec] = {
    "low": EffortSpec("low", "<|low|>", think_budget=20, length_penalty=0.5),
    "high": EffortSpec("high", "<|high|>", think_budget=56, length_penalty=0.2),
    "max": EffortSpec("max", "<|max|>", think_budget=192, length_penalty=0.0),
}
# GLM-style thinking switch, set per prompt: thinking allowed (budget 64) or not at all.
THINKING_MODES: dict[str, EffortSpec] = {
    "think_on": EffortSpec("think_on", "<|think_on|>", think_budget=64, length_penalty=0.0),
    "think_off": EffortSpec("think_off", "<|think_off|>", think_budget=0, length_penalty=0.0),
}
KNOWN_EFFORTS: dict[str, EffortSpec] = {**DEFAULT_EFFORTS, **THINKING_MODES}
# The one effort of chat families (`TaskFamily.chat`): a real chat model answers in its own
# format, with no control token, no governed think span and no length penalty.
CHAT_EFFORT = EffortSpec("chat", "", think_budget=None, length_penalty=0.0)
# GLM-style thinking switched per assistant turn of a multi-turn episode: each turn is
# think_on or think_off by the task's schedule (meta["turn_modes"], see `turn_mode`). The
# spec's budget bounds the thinking of all think-on turns together (no length penalty); its
# control token is empty because every turn carries its own mode's token.
PER_TURN_EFFORTS: dict[str, EffortSpec] = {
    "think_mixed": EffortSpec("think_mixed", "",
                              think_budget=THINKING_MODES["think_on"].think_budget,
                              length_penalty=0.0),
}


def cell_name(domain: str, effort: str) -> str:
    """A (domain, effort) cell's name, "domain/effort": teacher keys, metrics and tables."""
    return f"{domain}/{effort}"


def cell_of(task: "Task") -> str:
    """The name of the cell `task` belongs to."""
    return cell_name(task.domain, task.effort)


@dataclasses.dataclass(frozen=True)
class Task:
    """One prompt in a (domain, effort) cell. `reference` is hidden from the model.

    meta may hold "difficulty", and "effort_spec" (an EffortSpec as a dict) to override the
    default for this cell. env names a multi-turn environment (None: single turn). split is
    "train" or "eval" for procedural tasks (part of the task's identity; JSONL keeps it) and
    None for tasks brought from elsewhere.
    """
    id: str
    family: str
    domain: str
    effort: str
    prompt: str
    reference: dict
    env: str | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    split: str | None = None

    def __post_init__(self):
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"task {self.id!r}: split={self.split!r}, expected one of "
                             f"{SPLITS} or None")
        if self.domain not in DOMAINS:
            raise ValueError(f"task {self.id!r}: domain={self.domain!r}, expected one of "
                             f"{DOMAINS}")
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ValueError(f"task {self.id!r}: prompt must be a non-empty str")
        if not self.prompt.isascii():
            raise ValueError(f"task {self.id!r}: prompt is not ASCII (the char tokenizer "
                             f"maps other characters to <unk>)")
        if not isinstance(self.reference, dict):
            raise ValueError(f"task {self.id!r}: reference must be a dict, got "
                             f"{type(self.reference).__name__}")
        effort_spec(self)  # unknown effort fails here, not at scoring time
        turn_modes(self)   # and a per-turn effort without a valid schedule

    def __hash__(self):  # the dict fields are unhashable; equal tasks share these
        return hash((self.id, self.family, self.effort, self.prompt, self.split))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        missing = [k for k in ("id", "family", "domain", "effort", "prompt") if k not in d]
        if missing:
            raise ValueError(f"task record {str(d)[:80]!r} lacks keys {missing}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"task {d['id']!r}: unknown keys {sorted(unknown)}")
        return cls(**{**d, "reference": d.get("reference", {}), "meta": d.get("meta", {})})

    def with_effort(self, effort: str | EffortSpec) -> "Task":
        """Same task in another effort cell (an EffortSpec also sets the cell's override)."""
        meta = dict(self.meta)
        if isinstance(effort, EffortSpec):
            meta["effort_spec"] = dataclasses.asdict(effort)
            effort = effort.name
        else:
            meta.pop("effort_spec", None)
        if effort not in PER_TURN_EFFORTS:   # a schedule belongs to a per-turn effort only
            meta.pop("turn_modes", None)
        return dataclasses.replace(self, effort=effort, meta=meta)


def effort_spec(task: Task) -> EffortSpec:
    """The task's EffortSpec: meta["effort_spec"] if set, else KNOWN_EFFORTS[effort] (or
    PER_TURN_EFFORTS[effort])."""
    if "effort_spec" in task.meta:
        spec = EffortSpec(**task.meta["effort_spec"])
        if spec.name != task.effort:
            raise ValueError(f"task {task.id!r}: effort={task.effort!r} but meta effort_spec "
                             f"is named {spec.name!r}")
        return spec
    if task.effort in PER_TURN_EFFORTS:
        return PER_TURN_EFFORTS[task.effort]
    if task.effort == CHAT_EFFORT.name:
        return CHAT_EFFORT
    if task.effort not in KNOWN_EFFORTS:
        raise ValueError(f"task {task.id!r}: effort={task.effort!r}, expected one of "
                         f"{tuple(KNOWN_EFFORTS) + tuple(PER_TURN_EFFORTS)}, "
                         f"{CHAT_EFFORT.name!r} or a meta['effort_spec']")
    return KNOWN_EFFORTS[task.effort]


def turn_modes(task: Task) -> tuple[str, ...] | None:
    """The per-turn thinking schedule of a per-turn task (effort in PER_TURN_EFFORTS), one
    THINKING_MODES name per assistant turn; None for every other task. Checked: only
    per-turn tasks carry one, of known modes, and only multi-turn tasks are per-turn."""
    modes = task.meta.get("turn_modes")
    if task.effort not in PER_TURN_EFFORTS:
        if modes is not None:
            raise ValueError(f"task {task.id!r}: meta['turn_modes'] is set but effort="
                             f"{task.effort!r} is switched per prompt; expected effort in "
                             f"{tuple(PER_TURN_EFFORTS)}")
        return None
    if task.env is None:
        raise ValueError(f"task {task.id!r}: effort={task.effort!r} switches thinking per "
                         f"assistant turn, but family {task.family!r} is single-turn; "
                         f"expected a multi-turn task (env set)")
    if (not isinstance(modes, (list, tuple)) or not modes
            or any(m not in THINKING_MODES for m in modes)):
        raise ValueError(f"task {task.id!r}: meta['turn_modes']={modes!r}, expected a "
                         f"non-empty list of {tuple(THINKING_MODES)} (one per assistant turn)")
    return tuple(modes)


def turn_mode(task: Task, turn: int) -> EffortSpec:
    """The EffortSpec assistant turn `turn` (0-based) obeys: the task's own effort, or for a
    per-turn task THINKING_MODES[meta["turn_modes"][turn]] (think_on / think_off)."""
    modes = turn_modes(task)
    if modes is None:
        return effort_spec(task)
    if not 0 <= turn < len(modes):
        raise ValueError(f"task {task.id!r}: turn {turn} has no thinking mode; its schedule "
                         f"meta['turn_modes'] covers turns 0..{len(modes) - 1}")
    return THINKING_MODES[modes[turn]]


def turn_control(task: Task, turn: int, role: str = "student") -> str:
    """The mode token an observation puts before turn `turn` of a per-turn task (student
    role); "" for other tasks and for the teacher role (which sees no control tokens)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}, expected one of {ROLES}")
    if role != "student" or turn_modes(task) is None:
        return ""
    return turn_mode(task, turn).control_token


def chatml(messages: list[dict]) -> str:
    """A ChatML conversation (SmolLM2's and Qwen's format) opened for the assistant's reply."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                   for m in messages) + "<|im_start|>assistant\n"


def check_chat_effort(task: Task, family: "TaskFamily") -> None:
    """Chat families take the effort "chat" and only they do (their prompts carry no
    control token, so another effort would be a label the model never sees)."""
    if (family.chat is not None) != (task.effort == CHAT_EFFORT.name):
        raise ValueError(f"task {task.id!r}: family {family.name!r} "
                         f"{'is' if family.chat else 'is not'} a chat family but effort="
                         f"{task.effort!r}; expected effort {CHAT_EFFORT.name!r} "
                         f"{'' if family.chat else 'only '}for chat families")


def render_prompt(task: Task, role: str = "student") -> str:
    """Chat-format prompt. Student: "<|high|><|user|>3+4=?<|assistant|>"; teacher: no control.

    A per-turn task's prompt carries its first turn's mode token ("<|think_off|><|user|>...").
    The student's trajectory after this prefix is identical under both roles, so the
    teacher scores it by swapping only the prefix. A chat family's task (`TaskFamily.chat`)
    renders its conversation as ChatML, the same for both roles.
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r}, expected one of {ROLES}")
    # (a task of an unregistered family renders the synthetic way; a chat task's family
    # is looked up, loading the built-ins)
    family = (get_family(task.family) if task.effort == CHAT_EFFORT.name
              else _FAMILIES.get(task.family))
    if family is not None:
        check_chat_effort(task, family)
        if family.chat is not None:
            return chatml(family.chat(task))
    control = turn_mode(task, 0).control_token if role == "student" else ""
    return f"{control}<|user|>{task.prompt}<|assistant|>"


@dataclasses.dataclass(frozen=True)
class RewardResult:
    score: float
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


RewardFn = Callable[[Task, str], RewardResult]


@runtime_checkable
class Environment(Protocol):
    """Text-level environment. `stop_strings` end an assistant turn early (tool calls)."""
    stop_strings: tuple[str, ...]

    def reset(self, task: Task, role: str = "student") -> str: ...

    def step(self, assistant_text: str) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class TaskFamily:
    """A kind of task: `generate(rng, difficulty) -> (prompt, reference)` and `reward`.

    rng is a `random.Random`; difficulty an int >= 1 (the family's knob). `demo(task)`
    optionally writes a correct response within the task's think budget (SFT cold start).
    `reward_batch(tasks, responses)` optionally scores many at once (e.g. in parallel).
    `canonical(prompt, reference)` is the problem's identity for the train/eval split (two
    tasks with the same canonical form are the same problem); default: the prompt.
    `chat(task)`: set for natural-language families for real chat models (`envs.chat`): the
    conversation (system and user messages) the task's prompt renders as ChatML; such tasks
    take the effort "chat".
    """
    name: str
    domain: str
    generate: Callable[[Any, int], tuple[str, dict]] | None
    reward: RewardFn
    env: str | None = None
    demo: Callable[[Task], str] | None = None
    max_difficulty: int = 5
    reward_batch: Callable[[list, list], list] | None = None
    canonical: Callable[[str, dict], str] | None = None
    chat: Callable[["Task"], list] | None = None

    def canonical_form(self, prompt: str, reference: dict) -> str:
        return prompt if self.canonical is None else self.canonical(prompt, reference)


_FAMILIES: dict[str, TaskFamily] = {}
_ENVS: dict[str, Callable[[], Environment]] = {}
_BUILTINS = ("general", "agent", "coding", "chat")


def register_family(family: TaskFamily) -> TaskFamily:
    if family.domain not in DOMAINS:
        raise ValueError(f"family {family.name!r}: domain={family.domain!r}, expected one "
                         f"of {DOMAINS}")
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"task family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def register_env(name: str, factory: Callable[[], Environment]) -> None:
    if name in _ENVS and _ENVS[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered")
    _ENVS[name] = factory


def _load_builtins() -> None:
    for mod in _BUILTINS:
        importlib.import_module(f"opd_jax.envs.{mod}")


def get_family(name: str) -> TaskFamily:
    if name not in _FAMILIES:
        _load_builtins()
    if name not in _FAMILIES:
        raise KeyError(f"unknown task family {name!r}; registered: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def list_families() -> list[str]:
    _load_builtins()
    return sorted(_FAMILIES)


def make_env(task: Task) -> Environment:
    """A fresh environment for `task`: its named multi-turn env, else a SingleTurnEnv."""
    if task.env is None:
        return SingleTurnEnv()
    if task.env not in _ENVS:
        _load_builtins()
    if task.env not in _ENVS:
        raise KeyError(f"task {task.id!r}: unknown environment {task.env!r}; registered: "
                       f"{sorted(_ENVS)}")
    return _ENVS[task.env]()


def score(task: Task, response: str) -> RewardResult:
    """Score a single-turn response with the task family's reward (effort included)."""
    return get_family(task.family).reward(task, response)


class SingleTurnEnv:
    """One assistant turn, then done; the reward is the task family's reward."""
    stop_strings: tuple[str, ...] = ()

    def __init__(self):
        self.task: Task | None = None

    def reset(self, task: Task, role: str = "student") -> str:
        self.task = task
        return render_prompt(task, role)

    def step(self, assistant_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset(): call env.reset(task) first")
        return self.finish(score(self.task, assistant_text))

    def finish(self, res: RewardResult) -> StepResult:
        """End the episode with its reward (scored here or with others, `step_many`)."""
        self.task = None  # one step only
        return StepResult("", res.score, True, res.details)
