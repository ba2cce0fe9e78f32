"""What a training stage computes, in tokens and FLOPs: the unit in which recipes compare
their stages (the main job's compute table, the speed study).

FLOPs are the model's matmul FLOPs in Kaplan et al.'s approximation, with N every parameter
of the model (embeddings included) and the attention term left out:

* 2N per token through a forward pass: the student's rollout (prompt, tool-result and
  sampled tokens, each once: the KV cache keeps the rest), and the extra forward passes an
  objective asks for (old log-probs, the frozen reference of a KL penalty);
* 2N_T per token a teacher scores (N_T: that teacher's parameters);
* 6N per trained token (forward and backward), once per PPO epoch.

Policy stages count the rows' real tokens (padding excluded); SFT counts every position of
its rows (``batch_size x seq_len`` per optimizer step: packed rows are full). The counts are
saved in every checkpoint's meta, so a resumed run continues them, and written to
``compute.json`` in the run's folder when it finishes (`write`); `read` is how a report
gets them.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

FILE = "compute.json"


@dataclasses.dataclass
class Compute:
    """Token counts of a run (module doc). `teacher` maps a teacher key to its scored tokens."""
    rollouts: int = 0    # rollout rows (episodes)
    sampled: int = 0     # tokens the student sampled (part of `rollout`)
    rollout: int = 0     # tokens through the student while rolling out
    forward: int = 0     # tokens of the student's extra forward passes
    trained: int = 0     # tokens of forward + backward passes, over every PPO epoch
    teacher: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping | None) -> Compute:
        d = dict(d or {})
        return cls(**{k: d[k] for k in ("rollouts", "sampled", "rollout", "forward", "trained")
                      if k in d}, teacher=dict(d.get("teacher", {})))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def add_iteration(self, rows: Sequence[int], sampled: int, *, forward_passes: int,
                      epochs: int, teacher_rows: Mapping[str, Sequence[int]] = {}) -> None:
        """One policy iteration: `rows` the tokens of each rollout row (prompt + response),
        `sampled` the tokens sampled, `forward_passes` the extra student forward passes over
        every row, `epochs` the PPO epochs, `teacher_rows` the rows each teacher scored."""
        total = int(sum(rows))
        self.rollouts += len(rows)
        self.rollout += total
        self.sampled += int(sampled)
        self.forward += forward_passes * total
        self.trained += epochs * total
        for key, r in teacher_rows.items():
            self.teacher[key] = self.teacher.get(key, 0) + int(sum(r))

    def flops(self, n_params: int, teacher_params: Mapping[str, int] = {}) -> dict:
        """{"rollout", "forward", "teacher", "train", "total"} FLOPs (module doc)."""
        missing = sorted(set(self.teacher) - set(teacher_params))
        if missing:
            raise ValueError(f"teacher_params lacks {missing}: expected the parameter count "
                             f"of every teacher that scored tokens ({sorted(self.teacher)})")
        out = {"rollout": 2.0 * n_params * self.rollout,
               "forward": 2.0 * n_params * self.forward,
               "teacher": sum(2.0 * teacher_params[k] * t for k, t in self.teacher.items()),
               "train": 6.0 * n_params * self.trained}
        out["total"] = sum(out.values())
        return out


def write(workdir: str, compute: Compute, n_params: int,
          teacher_params: Mapping[str, int] = {}) -> dict:
    """compute.json of a finished run: tokens, parameter counts and FLOPs."""
    rec = {"tokens": compute.to_dict(), "params": int(n_params),
           "teacher_params": {k: int(v) for k, v in teacher_params.items()},
           "flops": compute.flops(n_params, teacher_params)}
    tmp = os.path.join(workdir, FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=2)
    os.replace(tmp, os.path.join(workdir, FILE))
    return rec


def read(workdir: str) -> dict | None:
    """A run's compute.json, or None (a run that predates it, or a merge)."""
    path = os.path.join(workdir, FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def format_flops(x: float) -> str:
    """"3.2e15" style, or "0" (a merge)."""
    return "0" if not x else f"{x:.2e}".replace("e+", "e")
