"""The pretraining corpus of the built-in base model: demos from the train split only.

Every family that has a generator and a demo contributes, at every difficulty and under
every known effort (low/high/max and the think_on/think_off switch), so the corpus holds
scratchpads of every length the budgets allow and direct answers (think_off, and low at
high difficulty). The testbed families (chain, tool_chain, code_trace) get more examples.

    examples = pretraining_corpus(per_cell=300, testbed_per_cell=1200, seed=0)
    # [{"prompt": "<|max|><|user|>7+3-4=?<|assistant|>", "response": [{"text": ..., "train": True}]}]

Tasks come from `TaskSource(split="train")`: no evaluation problem can be in the corpus.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from opd_jax import envs

TESTBED_FAMILIES = ("chain", "tool_chain", "code_trace")


def demo_example(task: envs.Task) -> dict | None:
    """A task's student prompt and its family's demo as an SFT example (None: no demo).

    Multi-turn demos keep the environment's observations ("<|tool|>...<|assistant|>") in
    the response as untrained pieces: the model learns its own turns, never the tools'.
    """
    if task.split == "eval":
        raise ValueError(f"task {task.id!r} is from the eval split: it must not be trained on")
    fam = envs.get_family(task.family)
    if fam.demo is None:
        return None
    parts = re.split(r"(<\|tool\|>.*?<\|assistant\|>)", fam.demo(task), flags=re.DOTALL)
    pieces = [{"text": p, "train": not p.startswith("<|tool|>")} for p in parts if p]
    return {"prompt": envs.render_prompt(task, role="student"), "response": pieces}


def corpus_families() -> list[str]:
    """Families of the synthetic base's corpus: every family with a generator and a demo
    that speaks the synthetic format (chat families are for real chat models)."""
    return [f for f in envs.list_families()
            if envs.get_family(f).generate is not None and envs.get_family(f).demo is not None
            and envs.get_family(f).chat is None]


def pretraining_corpus(*, per_cell: int, testbed_per_cell: int, seed: int = 0,
                       efforts=tuple(envs.KNOWN_EFFORTS),
                       dose: Mapping[str, Mapping] | None = None) -> list[dict]:
    """SFT examples for every (family, difficulty, effort) of the train split.

    `dose` ({family: {difficulty: n}}, difficulties as ints or strings) sets the demos per
    effort of those cells instead of per_cell / testbed_per_cell: a base with headroom on
    the recipes' teacher cells sees few or no demos at their evaluation difficulty and
    above, and the full count below (so formats, effort tokens and tools are learnt)."""
    if per_cell < 0 or testbed_per_cell < 0 or per_cell + testbed_per_cell == 0:
        raise ValueError(f"per_cell={per_cell}, testbed_per_cell={testbed_per_cell}: expected "
                         f"non-negative counts, not both 0")
    dose = check_dose(dose)
    out = []
    for fam in corpus_families():
        full = testbed_per_cell if fam in TESTBED_FAMILIES else per_cell
        for d in range(1, envs.get_family(fam).max_difficulty + 1):
            n = dose.get((fam, d), full)
            if n == 0:
                continue
            for e in efforts:
                src = envs.TaskSource(fam, size=n, seed=seed, difficulty=d, effort=e)
                out += [ex for ex in map(demo_example, src) if ex is not None]
    return out


def check_dose(dose: Mapping[str, Mapping] | None) -> dict[tuple[str, int], int]:
    """{(family, difficulty): n} of a dose map, each family a corpus family, each difficulty
    one of its levels and each count an int >= 0; a clear error naming the entry otherwise."""
    out = {}
    for fam, levels in dict(dose or {}).items():
        if fam not in corpus_families():
            raise ValueError(f"data.corpus.dose family {fam!r}: expected one of the corpus "
                             f"families {corpus_families()}")
        top = envs.get_family(fam).max_difficulty
        for d, n in dict(levels).items():
            try:
                level = int(d)
            except (TypeError, ValueError):
                level = None
            if level is None or not 1 <= level <= top:
                raise ValueError(f"data.corpus.dose[{fam!r}] difficulty {d!r}: expected 1..{top}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"data.corpus.dose[{fam!r}][{d!r}]={n!r}: expected an int >= 0 "
                                 f"(demos per effort)")
            out[(fam, level)] = n
    return out
