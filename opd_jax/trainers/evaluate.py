"""Evaluate a policy on every (domain, effort) cell of a task grid.

One row per cell: mean reward, pass rate (fraction of episodes the verifier marked correct)
and mean response length (sampled tokens), over `n` held-out tasks per cell. The tasks of a
cell come from the eval split of its family (`envs.split_of`: a hash of the problem, so no
problem a trainer can draw is ever evaluated), and every effort of a domain sees the same
problems, so efforts differ only by their control token and budget.

    rows = evaluate_model(model, tokenizer, {"general": "arithmetic"}, n=64)
    print(format_rows(rows))

The command line form evaluates any checkpoint (an HF folder or an opd_jax workdir):

    opd-jax eval --checkpoint runs/opd_kimi --config configs/eval.py:grid --out runs/opd_kimi/eval
"""
from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from opd_jax import envs
from opd_jax.envs import cell_of
from opd_jax.trainers import config_schema
from opd_jax.episodes import SamplingConfig, play
from opd_jax.models import (ModelRef, build_tokenizer, check_tokenizer, check_tokenizer_fits,
                            resolve_tokenizer)

COLUMNS = ("cell", "domain", "effort", "family", "difficulty", "n", "reward", "pass_rate",
           "length")


def heldout_tasks(families: Mapping[str, str], efforts: Sequence[str], *, n: int, seed: int,
                  difficulty: int = 1, split: str = "eval") -> list[envs.Task]:
    """n distinct tasks per (domain, effort) cell from the eval split (disjoint from
    training; or ``split="train"``: a validation draw of training problems, for choices made
    on them).

    Distinct: no two tasks of a cell are the same problem (the family's canonical form), so
    a standard error over a cell's tasks counts problems; a draw that repeats a problem is
    skipped. A cell whose split holds fewer than n problems (found within DISTINCT_DRAWS x n
    draws) is refused, naming the family, difficulty and how many it found."""
    if n <= 0:
        raise ValueError(f"eval n={n}: expected a positive number of tasks per cell")
    out = []
    for domain, fam in families.items():
        envs.check_family_domain(fam, domain)
        for effort in efforts:
            out += _distinct(envs.TaskSource(fam, size=DISTINCT_DRAWS * n, seed=seed,
                                             difficulty=difficulty, effort=effort,
                                             split=split), n)
    return out


DISTINCT_DRAWS = 20     # draws allowed per distinct problem asked for, before refusing


def _distinct(source, n: int) -> list[envs.Task]:
    fam = envs.get_family(source.family)
    seen: set[str] = set()
    tasks = []
    for task in source:
        canon = fam.canonical_form(task.prompt, task.reference)
        if canon not in seen:
            seen.add(canon)
            tasks.append(task)
            if len(tasks) == n:
                return tasks
    raise ValueError(f"{source.family} at difficulty {source.difficulty}: only {len(tasks)} "
                     f"distinct {source.split}-split problems in {len(source)} draws, fewer "
                     f"than n={n}; expected a smaller n or a higher difficulty (a larger "
                     f"problem space)")


def evaluate_tasks(model, tokenizer, tasks: Sequence[envs.Task], sampling: SamplingConfig, *,
                   seed: int = 0, batch_size: int = 64) -> list[dict]:
    """Play `tasks` in batches and aggregate per cell (rows in first-seen cell order)."""
    envs.check_chat_template(tokenizer, [t.family for t in tasks])
    episodes = []
    for i in range(0, len(tasks), batch_size):
        episodes += play(model, tokenizer, tasks[i:i + batch_size], sampling,
                         seed=seed * 7_919 + i)
    return aggregate(episodes)


def aggregate(episodes) -> list[dict]:
    cells: dict[str, list] = {}
    for e in episodes:
        cells.setdefault(cell_of(e.task), []).append(e)
    rows = []
    for cell, eps in cells.items():
        t = eps[0].task
        passes = [float(e.info.get("correct", 0.0)) for e in eps]
        rows.append({
            "cell": cell, "domain": t.domain, "effort": t.effort, "family": t.family,
            "difficulty": int(t.meta.get("difficulty", 0)), "n": len(eps),
            "reward": float(np.mean([e.reward for e in eps])),
            "pass_rate": float(np.mean(passes)),
            "length": float(np.mean([e.sampled_tokens for e in eps])),
            # per task, in task order: paired comparisons of two models on the same problems
            "rewards": [float(e.reward) for e in eps],
            "passes": passes,
        })
    return rows


def evaluate_model(model, tokenizer, families: Mapping[str, str],
                   efforts: Sequence[str] = ("low", "high", "max"), *, n: int = 32,
                   seed: int = 0, difficulty: int = 1, sampling: SamplingConfig | None = None,
                   batch_size: int = 64) -> list[dict]:
    """Rows of (cell, reward, pass_rate, length) on n held-out tasks per cell.

    Default sampling is greedy (temperature 0): the table is a deterministic function of the
    weights.
    """
    sampling = sampling or SamplingConfig(temperature=0.0)
    tasks = heldout_tasks(families, efforts, n=n, seed=seed, difficulty=difficulty)
    return evaluate_tasks(model, tokenizer, tasks, sampling, seed=seed, batch_size=batch_size)


def heldout_metrics(rows: list[dict], cell_keys: dict[str, str]) -> dict:
    """heldout/<cell>/{reward,pass_rate,length}, heldout/reward, teacher/<key>/heldout_reward."""
    out = {"heldout/reward": float(np.mean([r["reward"] for r in rows]))}
    by_key = defaultdict(list)
    for r in rows:
        for k in ("reward", "pass_rate", "length"):
            out[f"heldout/{r['cell']}/{k}"] = r[k]
        if r["cell"] in cell_keys:
            by_key[cell_keys[r["cell"]]].append(r["reward"])
    out |= {f"teacher/{k}/heldout_reward": float(np.mean(v)) for k, v in by_key.items()}
    return out


class HeldOut:
    """A policy trainer's held-out evaluation: `cfg.eval.n` eval-split tasks for each
    (domain, family, effort) cell of the run, played with `cfg.eval.sampling`.

    `cell_weights` maps "domain/effort" to its teacher weights (OPD runs): a cell's
    held-out reward is also reported under the teacher with the largest weight there.
    ``rows, metrics = heldout(model)``.
    """

    def __init__(self, cfg, cells: Sequence[tuple[str, str, str]], tokenizer,
                 cell_weights: Mapping[str, Mapping[str, float]] | None = None):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.tasks = [t for d, fam, e in cells
                      for t in heldout_tasks({d: fam}, (e,), n=cfg.eval.n,
                                             seed=cfg.tasks.seed + cfg.eval.seed,
                                             difficulty=cfg.tasks.difficulty)]
        self.sampling = SamplingConfig(**dict(cfg.eval.sampling))
        self.cell_keys = {c: max(w, key=w.get) for c, w in (cell_weights or {}).items()}

    def due(self, done: int, steps: int) -> bool:
        """Evaluate after iteration `done`: every `eval.every` iterations and at the end."""
        return bool(self.cfg.eval.every and done % self.cfg.eval.every == 0) or done == steps

    def __call__(self, model) -> tuple[list[dict], dict]:
        rows = evaluate_tasks(model, self.tokenizer, self.tasks, self.sampling,
                              seed=self.cfg.eval.seed, batch_size=self.cfg.eval.batch_size)
        return rows, heldout_metrics(rows, self.cell_keys)


def format_rows(rows: Sequence[dict], title: str | None = None) -> str:
    """A markdown table of evaluation rows."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| cell | n | reward | pass rate | length |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['cell']} | {r['n']} | {r['reward']:.3f} | {r['pass_rate']:.3f} | "
              f"{r['length']:.1f} |" for r in rows]
    return "\n".join(lines)


def write_rows(rows: Sequence[dict], out_dir: str, name: str = "eval") -> tuple[str, str]:
    """Write `name`.json and `name`.csv under out_dir (atomically); returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    jpath, cpath = os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, f"{name}.csv")
    tmp = jpath + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(list(rows), f, indent=2)
    os.replace(tmp, jpath)
    tmp = cpath + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, cpath)
    return jpath, cpath


def evaluate_checkpoint(path: str, cfg, *, out_dir: str | None = None) -> list[dict]:
    """Load an HF folder or an opd_jax workdir and evaluate it as `cfg` (configs/eval.py) says."""
    config_schema.validate(cfg)        # every value first: nothing is opened for a bad config
    spec = ModelRef(path)
    tok_spec = resolve_tokenizer(cfg.tokenizer, path)
    tokenizer = build_tokenizer(tok_spec)
    check_tokenizer_fits(tokenizer, spec.model_config())
    check_tokenizer(spec, tokenizer, tok_spec, what="eval checkpoint")   # not 0.000 as real
    model = spec.load()
    rows = evaluate_model(model, tokenizer, dict(cfg.tasks.families), tuple(cfg.tasks.efforts),
                          n=cfg.eval.n, seed=cfg.eval.seed, difficulty=cfg.tasks.difficulty,
                          sampling=SamplingConfig(**dict(cfg.eval.sampling)),
                          batch_size=cfg.eval.batch_size)
    if out_dir:
        write_rows(rows, out_dir)
    return rows
