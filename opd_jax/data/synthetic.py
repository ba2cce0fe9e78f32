"""Built-in synthetic SFT task (no files, deterministic under a seed).

``addition``: ``<|user|>a+b<|assistant|>`` -> ``c`` with ``a, b`` of up to `max_digits`
digits. Tiny models learn it in a few hundred steps on a CPU, which makes it the smoke test
for the whole SFT stack.
"""
from __future__ import annotations

import numpy as np

TASKS = ("addition",)


def synthetic_examples(task: str = "addition", *, num_examples: int = 1000, seed: int = 0,
                       max_digits: int = 2) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; available: {', '.join(TASKS)}")
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    rng = np.random.default_rng(seed)
    hi = 10 ** max_digits
    a = rng.integers(0, hi, num_examples)
    b = rng.integers(0, hi, num_examples)
    return [{"prompt": f"<|user|>{x}+{y}<|assistant|>", "response": str(x + y)}
            for x, y in zip(a.tolist(), b.tolist())]
