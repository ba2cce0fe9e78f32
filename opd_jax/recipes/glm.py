"""GLM: one line of sequential stages, then cross-stage OPD from earlier stage checkpoints.

(cold start ->) Reasoning RL -> (Agentic RL ->) General RL, each stage continuing from the
previous one; a stage is a specialist SFT on its own domains' demos (``sft_<stage>``) then
GRPO on them (``<stage>``). After every stage every domain is evaluated, so the table shows
what later stages make the model forget. The student starts from the last stage and
distills, per domain, the stage checkpoint that was best at it (``stage_teachers``: domain ->
stage) with the log-ratio advantage in the PPO-clip surrogate (group size 1). Thinking is
switched per prompt (``<|think_on|>`` / ``<|think_off|>``), and every stage and the student
train on both modes; on the multi-turn domains of ``c.per_turn`` (agent) also per assistant
turn (effort ``think_mixed``: each turn opened by its own mode token, docs/envs.md). The RL
stages of ``c.judge_stages`` (General RL) mix a generative reward model's score into the
verifier's reward (``c.judge``, a ``rewards.judge`` section: opd_jax/trainers/judge.py).

The report reads pass rate (verifier correctness), each seed on its own held-out problems,
paired per problem and pooled over a domain's modes and the seeds. Claims: every RL stage
gains >= GAIN on its own domains over the model it started from, beyond GAIN_K se; the last
stage costs every earlier domain >= LOSS beyond LOSS_K se; the student recovers >= RECOVER
of that loss and keeps >= KEEP of the last stage's gain.
"""
from __future__ import annotations

import os

import ml_collections
import numpy as np

from opd_jax import envs
from opd_jax.plotting.recipes import plot_seed_lines
from opd_jax.recipes import report as rp
from opd_jax.recipes.kimi_k3 import (GAIN, GAIN_K, LOSS, LOSS_K, eval_seed,
                                     specialist_start, stage_config, start_path)
from opd_jax.recipes.pipeline import Stage


PER_TURN = "think_mixed"      # the per-turn thinking effort (envs.PER_TURN_EFFORTS)
RECOVER, KEEP = 0.9, 0.95     # OPD recovers 90% of the loss, keeps 95% of the last gain


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
    stages: list[Stage] = []
    start = None                # the base itself (c.start) unless a cold start is trained
    if c.sft.train.steps:
        stages.append(Stage("sft", "sft", stage_config(c.sft, seed, domains,
                                                       *cells_of(c, domains))))
        start = "sft"
    prev = start
    for name, stage_domains in c.stages:
        fams = {d: domains[d] for d in stage_domains}
        efforts, cells = cells_of(c, fams)
        prev = specialist_start(c, stages, seed, f"sft_{name}", fams, efforts, prev, cells)
        rl = stage_config(c.rl, seed, fams, efforts, cells)
        if name in tuple(c.get("judge_stages", ())):
            rl.rewards.judge.update(dict(c.judge))
        stages.append(Stage(name, "grpo", rl, init_from=prev))
        prev = name
    names = [*([start] if start else []), *rl_names]
    bad = {d: s for d, s in c.stage_teachers.items() if s not in names or d not in domains}
    if bad:
        raise ValueError(f"stage_teachers {bad}: domains must be in {sorted(domains)} and "
                         f"stages in {names}")
    student = stage_config(c.student, seed, domains, *cells_of(c, domains))
    student.teachers.routing = "table"
    student.teachers.table = {d: d for d in domains}
    stages.append(Stage("student", "opd", student, init_from=prev,
                        teachers={d: c.stage_teachers[d] for d in domains}))
    # task arithmetic needs the line's start as its base (the base itself: a path)
    merge = dict(c.merge) | ({"base": start_path(c)} if start is None
                             and c.merge.method != "average" else {})
    stages.append(Stage("merge", "merge", ml_collections.ConfigDict(merge),
                        init_from=start, teachers={n: n for n in rl_names}))
    return stages


START = "start"       # the line's first model: the cold start "sft", or the base itself


def collect(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    """Evaluate every seed's stage line into results.json's dict (`report.report` adds the
    claims and the provenance).

    Every model of a seed is evaluated greedily on the seed's own held-out problems
    (``c.eval.seed + seed``: pooled standard errors count problems), so stage-to-stage
    differences are paired per problem (pooled over a domain's thinking modes and the
    seeds). Rows keep per-problem passes (verifier correctness), which the claims read,
    and rewards.
    """
    domains = dict(c.domains)
    cells = [(d, fam, m) for d, fam in domains.items() for m in domain_modes(c, d)]
    names = [envs.cell_name(d, m) for d, _, m in cells]
    rl_stages = [n for n, _ in c.stages]
    line = [START, *rl_stages, "student", "merge"]
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        stages = build(c, seed)
        cold = stages[0].name == "sft"

        def ev(stage):
            name, path = ((("sft", None) if cold else (START, start_path(c)))
                          if stage == START else (stage, None))
            return rp.evaluate_stage(sw, name, cells, c.eval, tokenizer=tokenizer,
                                     difficulty=c.eval.difficulty, path=path,
                                     seed=eval_seed(c, seed), n=c.eval.n)
        per_seed.append({s: ev(s) for s in line})
    keep = ("pass_rate", "passes", "reward", "rewards")
    return {
        "recipe": "glm", "seeds": list(seeds), "stages": line,
        "stage_domains": {n: list(ds) for n, ds in c.stages},
        "stage_teachers": {d: (START if t == "sft" else t)
                           for d, t in dict(c.stage_teachers).items()},
        "modes": {d: list(domain_modes(c, d)) for d in domains},
        "eval": rp.eval_meta(c.eval) | {"per_seed_problems": True},
        # cell -> stage -> per-seed row (pass rate and reward, per problem too)
        "cells": {n: {s: [{k: r[s][n][k] for k in keep} for r in per_seed] for s in line}
                  for n in names}}


def plot(c: ml_collections.ConfigDict, workdir: str, results: dict) -> None:
    """stages.png: each domain's pass rate after every stage of the line, one line per
    domain (mean over seeds, std error bars)."""
    points = results["stages"][:-1]
    plot_seed_lines(os.path.join(workdir, "stages.png"), [s.replace("_", " ") for s in points],
                    {d: [[_domain(results, s, d)[k] for s in points]
                         for k in range(len(results["seeds"]))] for d in results["modes"]},
                    title="glm: forgetting across RL stages, recovery by cross-stage OPD",
                    ylabel="held-out pass rate")


def _domain(results: dict, stage: str, d: str, key: str = "pass_rate") -> list[float]:
    """A domain's pass rate (or reward) after `stage`, per seed: the mean over its modes."""
    cells = [results["cells"][envs.cell_name(d, m)][stage] for m in results["modes"][d]]
    return [float(np.mean([c[k][key] for c in cells])) for k in range(len(results["seeds"]))]


def _pooled(results: dict, stage: str, d: str) -> list[float]:
    """Per-problem passes of a domain after `stage`, every mode and seed in one order."""
    return [x for m in results["modes"][d]
            for r in results["cells"][envs.cell_name(d, m)][stage] for x in r["passes"]]


def _paired(results: dict, a: str, b: str, d: str) -> dict:
    """Stage a - stage b on domain d, paired per problem."""
    return rp.paired(_pooled(results, a, d), _pooled(results, b, d))


def _rl_stages(results: dict) -> list[str]:
    """The RL stages of results.json's stage line, in order."""
    return [s for s in results["stages"] if s not in (START, "student", "merge")]


def claims(results: dict) -> list[dict]:
    """The recipe's claims on pass rate, from a results.json dict alone (paired over the same
    problems, pooled over a domain's modes and the seeds; "beats by d beyond k se":
    `report.beats`)."""
    rl = _rl_stages(results)
    last = rl[-1]
    line = [START, *rl]
    before_last = line[-2]
    learned = {}                   # each stage on its own domains vs the model it started from
    for i, s in enumerate(rl):
        for d in results["stage_domains"][s]:
            learned[f"{s}: {d}"] = _paired(results, s, line[i], d)
    # what the last stage cost each earlier domain: its teacher stage - the last stage
    forgot = {d: _paired(results, t, last, d) for d, t in results["stage_teachers"].items()
              if t != last}
    lost = {d: p for d, p in forgot.items() if p["diff"] > 0}
    rec = {d: _paired(results, "student", last, d)["diff"] / p["diff"] for d, p in lost.items()}
    kept = {}
    for d in results["stage_domains"][last]:
        gain = _paired(results, last, before_last, d)["diff"]
        kept[d] = (_paired(results, "student", before_last, d)["diff"] / gain if gain > 0
                   else float("nan"))
    return [
        {"claim": f"each RL stage (its SFT and GRPO) gains >= {GAIN} pass rate on its own "
                  f"domains over the model it started from, beyond {GAIN_K:g} se",
         "pass": all(rp.beats(p, GAIN, GAIN_K) for p in learned.values()),
         "measured": rp.paired_list(learned)},
        {"claim": f"the last stage ({last}) costs each earlier domain >= {LOSS} pass rate "
                  f"beyond {LOSS_K:g} se (that domain's teacher stage - {last})",
         "pass": bool(forgot) and all(rp.beats(p, LOSS, LOSS_K) for p in forgot.values()),
         "measured": rp.paired_list(forgot) or "no domain has an earlier teacher stage"},
        {"claim": f"cross-stage OPD recovers >= {RECOVER:.0%} of that loss on every earlier "
                  f"domain: (student - {last}) / (teacher stage - {last})",
         "pass": bool(forgot) and len(lost) == len(forgot)
                 and all(v >= RECOVER for v in rec.values()),
         "measured": ", ".join(f"{d}: {v:.0%}" for d, v in rec.items()) or
                     "no earlier domain lost pass rate (nothing to recover)"},
        {"claim": f"while keeping >= {KEEP:.0%} of the last stage's gain: (student - "
                  f"{before_last}) / ({last} - {before_last}) on its domains",
         "pass": all(np.isfinite(v) and v >= KEEP for v in kept.values()),
         "measured": ", ".join(f"{d}: {v:.1%}" for d, v in kept.items())},
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
    mode_rows = [[n] + [rp.fmt([r["pass_rate"] for r in v[s]]) for s in line]
                 for n, v in results["cells"].items()]
    reward_rows = [[d] + [rp.fmt(_domain(results, s, d, "reward")) for s in line]
                   for d in results["modes"]]
    per_turn = [d for d, ms in results["modes"].items() if PER_TURN in ms]
    md = [f"# glm results ({len(seeds)} seed(s): {list(seeds)})", "",
          rp.provenance_line(meta), "",
          f"Held-out pass rate (verifier correctness) per domain (eval split, greedy, "
          f"n={ev['n']} per cell and seed, each seed its own problems, difficulty "
          f"{ev['difficulty']}; a domain's pass rate is the mean over its thinking modes: on, "
          f"off" + (f", and per-turn mixed on {', '.join(per_turn)}" if per_turn else "")
          + f") after every stage; mean ± std over seeds. Forgotten = teacher stage - {last}; "
          f"recovered = student - {last}.", "",
          rp.markdown_table(["domain", *line, "forgotten", "recovered"], table), "",
          "Per thinking mode (think_on / think_off: one mode per prompt; think_mixed: the "
          "mode switched per assistant turn by the task's schedule, a turn that disobeys "
          "its mode fails the episode):", "",
          rp.markdown_table(["cell", *line], mode_rows), "",
          "## Claims", "",
          "Paired over the same held-out problems, pooled over a domain's modes and the "
          "seeds; standard errors count problems.", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", "## Reward (the training signal; no claim reads it)", "",
           rp.markdown_table(["domain", *line], reward_rows), "",
           "![stages](stages.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
