"""GLM: one line of sequential stages, then cross-stage OPD from earlier stage checkpoints.

SFT -> Reasoning RL -> Agentic RL -> General RL, each stage continuing from the previous
one; after every stage every domain is evaluated, so the table shows what later stages make
the model forget. The student starts from the last stage and distills, per domain, the stage
checkpoint that was best at it (``stage_teachers``: domain -> stage) with the log-ratio
advantage in the PPO-clip surrogate (group size 1). Thinking is switched per prompt
(``<|think_on|>`` / ``<|think_off|>``), and every stage and the student train on both modes;
on the multi-turn domains of ``c.per_turn`` (agent) also per assistant turn (effort
``think_mixed``: each turn opened by its own mode token, docs/envs.md). The RL stages of
``c.judge_stages`` (General RL) mix a generative reward model's score into the verifier's
reward (``c.judge``, a ``rewards.judge`` section: opd_jax/trainers/judge.py).
"""
from __future__ import annotations

import os

import ml_collections
import numpy as np

from opd_jax import envs
from opd_jax.plotting.recipes import plot_seed_lines
from opd_jax.recipes import report as rp
from opd_jax.recipes.kimi_k3 import specialist_start, stage_config
from opd_jax.recipes.pipeline import Stage


PER_TURN = "think_mixed"      # the per-turn thinking effort (envs.PER_TURN_EFFORTS)


def domain_modes(c: ml_collections.ConfigDict, domain: str) -> tuple[str, ...]:
    """The thinking modes a domain trains and is evaluated on: the per-prompt ones
    (``c.efforts``), plus per-turn ``think_mixed`` for the domains of ``c.per_turn``."""
    return tuple(c.efforts) + ((PER_TURN,) if domain in tuple(c.get("per_turn", ())) else ())


def cells_of(c: ml_collections.ConfigDict, families: dict) -> tuple[tuple, tuple]:
    """(efforts, cells) of a stage on `families`: cells () when every domain has every mode,
    else the "domain/mode" cells that `domain_modes` gives."""
    efforts = tuple(dict.fromkeys(m for d in families for m in domain_modes(c, d)))
    cells = tuple(envs.cell_name(d, m) for d in families for m in domain_modes(c, d))
    return efforts, (() if len(cells) == len(families) * len(efforts) else cells)


def build(c: ml_collections.ConfigDict, seed: int) -> list[Stage]:
    domains = dict(c.domains)
    bad_turn = [d for d in c.get("per_turn", ()) if d not in domains or
                envs.get_family(domains[d]).env is None]
    if bad_turn:
        raise ValueError(f"per_turn {bad_turn}: expected domains of {sorted(domains)} whose "
                         f"family is multi-turn (per-turn thinking needs assistant turns)")
    rl_names = [n for n, _ in c.stages]
    bad_judge = [n for n in c.get("judge_stages", ()) if n not in rl_names]
    if bad_judge:
        raise ValueError(f"judge_stages {bad_judge}: expected RL stages of {rl_names}")
    stages = [Stage("sft", "sft", stage_config(c.sft, seed, domains, *cells_of(c, domains)))]
    prev = "sft"
    for name, stage_domains in c.stages:
        fams = {d: domains[d] for d in stage_domains}
        efforts, cells = cells_of(c, fams)
        prev = specialist_start(c, stages, seed, f"sft_{name}", fams, efforts, prev, cells)
        rl = stage_config(c.rl, seed, fams, efforts, cells)
        if name in tuple(c.get("judge_stages", ())):
            rl.rewards.judge.update(dict(c.judge))
        stages.append(Stage(name, "grpo", rl, init_from=prev))
        prev = name
    names = ["sft", *(n for n, _ in c.stages)]
    bad = {d: s for d, s in c.stage_teachers.items() if s not in names or d not in domains}
    if bad:
        raise ValueError(f"stage_teachers {bad}: domains must be in {sorted(domains)} and "
                         f"stages in {names}")
    student = stage_config(c.student, seed, domains, *cells_of(c, domains))
    student.teachers.routing = "table"
    student.teachers.table = {d: d for d in domains}
    stages.append(Stage("student", "opd", student, init_from=prev,
                        teachers={d: c.stage_teachers[d] for d in domains}))
    stages.append(Stage("merge", "merge", ml_collections.ConfigDict(dict(c.merge)),
                        init_from="sft", teachers={n: n for n, _ in c.stages}))
    return stages


def collect(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    """Evaluate every seed's stage line into results.json's dict (`report.report` adds the
    claims and the provenance).

    Every model is evaluated greedily on the same held-out problems, so stage-to-stage
    differences are paired per problem (pooled over a domain's thinking modes and the
    seeds).
    """
    domains = dict(c.domains)
    cells = [(d, fam, m) for d, fam in domains.items() for m in domain_modes(c, d)]
    names = [envs.cell_name(d, m) for d, _, m in cells]
    rl_stages = [n for n, _ in c.stages]
    line = ["sft", *rl_stages, "student", "merge"]
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        per_seed.append({s: rp.evaluate_stage(sw, s, cells, c.eval, tokenizer=tokenizer,
                                              difficulty=c.eval.difficulty) for s in line})
    return {
        "recipe": "glm", "seeds": list(seeds), "stages": line,
        "stage_domains": {n: list(ds) for n, ds in c.stages},
        "stage_teachers": dict(c.stage_teachers),
        "modes": {d: list(domain_modes(c, d)) for d in domains},
        "eval": rp.eval_meta(c.eval),
        # cell -> stage -> per-seed {"reward", "rewards" (per problem)}
        "cells": {n: {s: [{"reward": r[s][n]["reward"], "rewards": r[s][n]["rewards"]}
                          for r in per_seed] for s in line} for n in names}}


def plot(c: ml_collections.ConfigDict, workdir: str, results: dict) -> None:
    """stages.png: each domain's reward after every stage of the line, one line per seed."""
    points = results["stages"][:-1]
    plot_seed_lines(os.path.join(workdir, "stages.png"), [s.replace("_", " ") for s in points],
                    {d: [[_domain(results, s, d)[k] for s in points]
                         for k in range(len(results["seeds"]))] for d in results["modes"]},
                    title="glm: forgetting across RL stages, recovery by cross-stage OPD")


def _domain(results: dict, stage: str, d: str) -> list[float]:
    """A domain's reward after `stage`, per seed: the mean over its thinking modes."""
    cells = [results["cells"][envs.cell_name(d, m)][stage] for m in results["modes"][d]]
    return [float(np.mean([c[k]["reward"] for c in cells])) for k in range(len(results["seeds"]))]


def _pooled(results: dict, stage: str, d: str) -> list[float]:
    """Per-problem rewards of a domain after `stage`, every mode and seed in one order."""
    return [x for m in results["modes"][d]
            for r in results["cells"][envs.cell_name(d, m)][stage] for x in r["rewards"]]


def _paired(results: dict, a: str, b: str, d: str) -> dict:
    """Stage a - stage b on domain d, paired per problem."""
    return rp.paired(_pooled(results, a, d), _pooled(results, b, d))


def _rl_stages(results: dict) -> list[str]:
    """The RL stages of results.json's stage line, in order."""
    return [s for s in results["stages"] if s not in ("sft", "student", "merge")]


def claims(results: dict) -> list[dict]:
    """The recipe's claims, from a results.json dict alone (paired over the same problems)."""
    rl = _rl_stages(results)
    last = rl[-1]
    line = ["sft", *rl]
    learned = {}                   # each stage on its own domains vs the model it started from
    for i, s in enumerate(rl):
        for d in results["stage_domains"][s]:
            learned[f"{s}: {d}"] = _paired(results, s, line[i], d)
    forgot = {d: _paired(results, t, last, d) for d, t in results["stage_teachers"].items()
              if t != last}
    lost = [d for d, p in forgot.items() if p["diff"] > 2 * p["se"]]
    rec = {d: _paired(results, "student", last, d)["diff"] / forgot[d]["diff"] for d in lost}
    keep = {d: rp.ratio(np.mean(_domain(results, "student", d)),
                        np.mean(_domain(results, last, d)))
            for d in results["stage_domains"][last]}
    return [
        {"claim": "each RL stage learns its own domains: above the model it started from "
                  "beyond 2 standard errors",
         "pass": all(p["diff"] > 2 * p["se"] for p in learned.values()),
         "measured": rp.paired_list(learned)},
        {"claim": f"later stages make the model forget: the last stage ({last}) is below each "
                  "earlier domain's teacher stage beyond 2 standard errors",
         "pass": bool(forgot) and len(lost) == len(forgot),
         "measured": rp.paired_list(forgot) or "no domain has an earlier teacher stage"},
        {"claim": "cross-stage OPD recovers >= 90% of what later stages made the model forget",
         "pass": bool(lost) and all(v >= 0.9 for v in rec.values()),
         "measured": ", ".join(f"{d}: {v:.0%}" for d, v in rec.items()) or
                     "no domain was forgotten beyond 2 standard errors (nothing to recover)"},
        {"claim": f"while keeping >= 95% of the last stage ({last})'s skill",
         "pass": all(v >= 0.95 for v in keep.values()),
         "measured": ", ".join(f"{d}: {v:.1%}" for d, v in keep.items())},
    ]


def write_markdown(path: str, results: dict) -> None:
    """results.md from a results.json dict (so the committed table can be regenerated)."""
    line, seeds, meta, ev = (results["stages"], results["seeds"], results["provenance"],
                             results["eval"])
    last = _rl_stages(results)[-1]
    table = []
    for d, t in results["stage_teachers"].items():
        f_ = [a - b for a, b in zip(_domain(results, t, d), _domain(results, last, d))]
        rec = [a - b for a, b in zip(_domain(results, "student", d), _domain(results, last, d))]
        table.append([d] + [rp.fmt(_domain(results, s, d)) for s in line] +
                     [rp.fmt(f_), rp.fmt(rec)])
    mode_rows = [[n] + [rp.fmt([r["reward"] for r in v[s]]) for s in line]
                 for n, v in results["cells"].items()]
    per_turn = [d for d, ms in results["modes"].items() if PER_TURN in ms]
    md = [f"# glm results ({len(seeds)} seed(s): {list(seeds)})", "",
          rp.provenance_line(meta), "",
          f"Held-out reward per domain (eval split, greedy, n={ev['n']} per cell and seed, "
          f"difficulty {ev['difficulty']}; a domain's reward is the mean over its thinking "
          f"modes: on, off" + (f", and per-turn mixed on {', '.join(per_turn)}" if per_turn
                               else "")
          + f") after every stage; mean ± std over seeds. Forgotten = teacher stage - {last}; "
          f"recovered = student - {last}.", "",
          rp.markdown_table(["domain", *line, "forgotten", "recovered"], table), "",
          "Per thinking mode (think_on / think_off: one mode per prompt; think_mixed: the "
          "mode switched per assistant turn by the task's schedule, a turn that disobeys "
          "its mode scores the episode 0):", "",
          rp.markdown_table(["cell", *line], mode_rows), "",
          "## Claims", "",
          "Paired over the same held-out problems, pooled over a domain's modes and the "
          "seeds.", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", "![stages](stages.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
