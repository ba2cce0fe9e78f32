"""Datasets of tasks as grain random-access sources, and JSONL import/export.

    src = TaskSource("arithmetic", size=1000, seed=0, difficulty=3, effort="high")
    src[7]                     # the same Task for the same (family, seed, difficulty, index)
    TaskSource("arithmetic", size=64, split="eval")   # held-out problems only
    ds = grain.MapDataset.source(src).shuffle(seed=1).batch(8, batch_fn=list)
    save_jsonl(list(src)[:10], "tasks.jsonl"); load_jsonl("tasks.jsonl")

Task i is generated from its own `random.Random` seeded with a hash of
(family, seed, difficulty, i), so any index is reproducible on its own, in any process,
in any order (what grain's shuffling and multi-worker reading need).

Held out by construction: every problem belongs to one split, "train" or "eval", by a stable
hash of the family name and its canonical form (`split_of`; 1 problem in EVAL_BUCKETS is
eval). A source of one split redraws (attempt 1, 2, ... of the same index) until the problem
is in its split, so no seed, size or index can make a train source yield an eval problem.
Trainers build train sources (the default); every evaluation builds eval sources.

A per-turn effort ("think_mixed", multi-turn families) also draws each task's thinking
schedule, `meta["turn_modes"]` (SCHEDULE_TURNS entries of think_on / think_off), from its
own rng keyed like the problem's (`draw_turn_modes`): the same index gives the same problem
under every effort and the same schedule every time.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from typing import Iterable, Sequence

from opd_jax.envs.base import (CHAT_EFFORT, KNOWN_EFFORTS, PER_TURN_EFFORTS, SPLITS, THINKING_MODES,
                               EffortSpec, Task, get_family)

EVAL_BUCKETS = 11       # 1/11 of every problem space is eval, 10/11 train
MAX_SPLIT_ATTEMPTS = 2_000
# Turns in a drawn per-turn schedule: more than any built-in environment allows
# (tool_chain at difficulty 5: 8 lookups + 3), and than the testbed's max_turns=10.
SCHEDULE_TURNS = 16


def task_rng(family: str, seed: int, difficulty: int, index: int,
             attempt: int = 0) -> random.Random:
    key = f"{family}/{seed}/{difficulty}/{index}" + (f"/{attempt}" if attempt else "")
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def draw_turn_modes(family: str, seed: int, difficulty: int, index: int,
                    turns: int = SCHEDULE_TURNS) -> list[str]:
    """A per-turn thinking schedule: each turn think_on or think_off with probability 1/2,
    from an rng keyed by (family, seed, difficulty, index) apart from the problem's."""
    rng = task_rng(f"{family}/turn_modes", seed, difficulty, index)
    return [rng.choice(tuple(THINKING_MODES)) for _ in range(turns)]


def split_of(family: str, prompt: str, reference: dict) -> str:
    """"train" or "eval" for a problem: a hash of (family, canonical form), never a seed."""
    canon = get_family(family).canonical_form(prompt, reference)
    h = hashlib.sha256(f"{family}\0{canon}".encode()).digest()
    return "eval" if int.from_bytes(h[:8], "little") % EVAL_BUCKETS == 0 else "train"


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    return split


class TaskSource:
    """Procedural tasks of one family in one (effort, difficulty) cell; len == size.

    effort: a name in KNOWN_EFFORTS (low/high/max, think_on/think_off), a per-turn effort
    (PER_TURN_EFFORTS: think_mixed, multi-turn families; each task gets its drawn schedule
    in meta["turn_modes"]) or an EffortSpec (stored in each task's meta so the cell's budget
    and penalty travel with the task).
    split: "train" (what trainers draw) or "eval" (what every evaluation draws).
    Default effort: "chat" for chat families (`envs.chat`), else "high".
    """

    def __init__(self, family: str, *, size: int, seed: int = 0, difficulty: int = 1,
                 effort: str | EffortSpec | None = None, split: str = "train"):
        fam = get_family(family)
        if effort is None:      # the family's default: "chat" for chat families, else "high"
            effort = CHAT_EFFORT.name if fam.chat is not None else "high"
        if fam.generate is None:
            raise ValueError(f"task family {family!r} has no generator (it reads tasks from "
                             f"JSONL: use JsonlSource)")
        if not 1 <= difficulty <= fam.max_difficulty:
            raise ValueError(f"{family}: difficulty={difficulty}, expected 1.."
                             f"{fam.max_difficulty}")
        if not (isinstance(size, int) and size > 0):
            raise ValueError(f"size={size!r}: expected a positive int")
        if fam.chat is not None and effort != CHAT_EFFORT.name:
            raise ValueError(f"{family} is a chat family (a real chat model's format): "
                             f"effort={effort!r}, expected {CHAT_EFFORT.name!r}")
        if isinstance(effort, str) and effort not in {**KNOWN_EFFORTS, **PER_TURN_EFFORTS,
                                                      CHAT_EFFORT.name: CHAT_EFFORT}:
            raise ValueError(f"effort={effort!r}: expected one of "
                             f"{tuple(KNOWN_EFFORTS) + tuple(PER_TURN_EFFORTS)}, "
                             f"{CHAT_EFFORT.name!r} (chat families) or an EffortSpec")
        if fam.chat is None and effort == CHAT_EFFORT.name:
            raise ValueError(f"effort={effort!r} is for chat families (envs.chat); family "
                             f"{family!r} speaks the synthetic format: expected one of "
                             f"{tuple(KNOWN_EFFORTS) + tuple(PER_TURN_EFFORTS)}")
        if isinstance(effort, str) and effort in PER_TURN_EFFORTS and fam.env is None:
            raise ValueError(f"effort={effort!r} switches thinking per assistant turn, but "
                             f"family {fam.name!r} is single-turn; expected a multi-turn "
                             f"family (e.g. tool_chain, tool_lookup)")
        # The name, not the object: sources must pickle for grain workers (a worker
        # imports the module that registers a custom family before reading).
        self.family, self.size, self.seed, self.difficulty = fam.name, size, seed, difficulty
        self.effort, self.split = effort, check_split(split)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Task:
        index = int(index)
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for TaskSource of size {self.size}")
        index %= self.size
        fam = get_family(self.family)
        for attempt in range(MAX_SPLIT_ATTEMPTS):
            prompt, ref = fam.generate(task_rng(fam.name, self.seed, self.difficulty, index,
                                                attempt), self.difficulty)
            if split_of(fam.name, prompt, ref) == self.split:
                break
        else:
            raise ValueError(f"{fam.name} at difficulty {self.difficulty}: no {self.split!r} "
                             f"problem in {MAX_SPLIT_ATTEMPTS} draws (the problem space is "
                             f"too small for a {self.split} split)")
        meta = {"difficulty": self.difficulty, "seed": self.seed, "index": index}
        effort = self.effort
        if isinstance(effort, EffortSpec):
            meta["effort_spec"] = {"name": effort.name, "control_token": effort.control_token,
                                   "think_budget": effort.think_budget,
                                   "length_penalty": effort.length_penalty}
            effort = effort.name
        if effort in PER_TURN_EFFORTS:
            meta["turn_modes"] = draw_turn_modes(fam.name, self.seed, self.difficulty, index)
        tid = f"{fam.name}-d{self.difficulty}-{self.split}-s{self.seed}-{index}"
        return Task(tid, fam.name, fam.domain, effort, prompt, ref, fam.env, meta, self.split)

    def __iter__(self):
        return (self[i] for i in range(self.size))

    def __repr__(self) -> str:  # grain uses it to check a checkpoint matches the source
        eff = self.effort if isinstance(self.effort, str) else repr(self.effort)
        return (f"TaskSource(family={self.family!r}, size={self.size}, "
                f"seed={self.seed}, difficulty={self.difficulty}, effort={eff!r}, "
                f"split={self.split!r})")


class MixtureSource:
    """Round-robin over several sources (e.g. the 3x3 grid): item i = src[i % k][i // k].

    len = k * min(len(s)), so every source contributes equally.
    """

    def __init__(self, sources: Sequence):
        if not sources:
            raise ValueError("MixtureSource needs at least one source")
        self.sources = list(sources)
        self._n = min(len(s) for s in self.sources)

    def __len__(self) -> int:
        return len(self.sources) * self._n

    def __getitem__(self, index: int) -> Task:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for MixtureSource of size "
                             f"{len(self)}")
        k = len(self.sources)
        return self.sources[index % k][index // k]

    def __repr__(self) -> str:
        return f"MixtureSource([{', '.join(repr(s) for s in self.sources)}])"


def check_family_domain(family: str, domain: str) -> None:
    """Raise unless task family `family` belongs to `domain` (a config's families table)."""
    if get_family(family).domain != domain:
        raise ValueError(f"family {family!r} is in domain {get_family(family).domain!r}, "
                         f"not {domain!r}")


def grid_source(families: dict[str, str], efforts: Sequence[str | EffortSpec] = ("low", "high",
                "max"), *, size: int, seed: int = 0, difficulty: int = 1,
                split: str = "train") -> MixtureSource:
    """A domain x effort grid: families maps domain -> family name.

    >>> grid_source({"general": "arithmetic", "coding": "code_expr"}, size=10)  # 2x3 cells
    """
    cells = []
    for domain, fam in families.items():
        check_family_domain(fam, domain)
        for e in efforts:
            cells.append(TaskSource(fam, size=size, seed=seed, difficulty=difficulty,
                                    effort=e, split=split))
    return MixtureSource(cells)


def save_jsonl(tasks: Iterable[Task], path: str | os.PathLike) -> int:
    """Write one JSON object per task; returns the count."""
    n = 0
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(t.to_dict(), sort_keys=True) + "\n")
            n += 1
    return n


def load_jsonl(path: str | os.PathLike) -> list[Task]:
    """Read tasks written by save_jsonl or by hand. A line needs at least prompt, family,
    domain and effort; a missing id becomes "<file stem>-<line>". Families are checked.
    """
    tasks, stem = [], os.path.splitext(os.path.basename(os.fspath(path)))[0]
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got "
                                 f"{type(d).__name__}")
            d.setdefault("id", f"{stem}-{lineno}")
            try:
                task = Task.from_dict(d)
                get_family(task.family)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            tasks.append(task)
    return tasks


class JsonlSource:
    """Tasks from a JSONL file as a grain source (read once, held in memory)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.tasks = load_jsonl(self.path)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, index: int) -> Task:
        return self.tasks[int(index)]

    def __repr__(self) -> str:
        return f"JsonlSource({self.path!r}, n={len(self.tasks)})"
