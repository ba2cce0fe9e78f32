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
    cells = tuple(f"{d}/{m}" for d in families for m in domain_modes(c, d))
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


def report(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    from opd_jax.recipes import report as rp
    domains = dict(c.domains)
    cells = [(d, fam, m) for d, fam in domains.items() for m in domain_modes(c, d)]
    names = [f"{d}/{m}" for d, _, m in cells]
    rl_stages = [n for n, _ in c.stages]
    line = ["sft", *rl_stages, "student", "merge"]
    last = rl_stages[-1]
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        per_seed.append({s: rp.evaluate_stage(sw, s, cells, c.eval, tokenizer=tokenizer,
                                              difficulty=c.eval.difficulty) for s in line})

    def dom(seed_r, stage, d):        # a domain's reward: mean over its thinking modes
        return float(np.mean([seed_r[stage][f"{d}/{m}"]["reward"]
                              for m in domain_modes(c, d)]))

    table, forget, recover, keep = [], {}, {}, {}
    for d in domains:
        peak_stage = c.stage_teachers[d]
        f_ = [dom(r, peak_stage, d) - dom(r, last, d) for r in per_seed]
        rec = [dom(r, "student", d) - dom(r, last, d) for r in per_seed]
        forget[d], recover[d] = f_, rec
        keep[d] = [rp.ratio(dom(r, "student", d), dom(r, last, d)) for r in per_seed]
        table.append([d] + [rp.fmt([dom(r, s, d) for r in per_seed]) for s in line] +
                     [rp.fmt(f_), rp.fmt(rec)])
    mode_rows = [[n] + [rp.fmt([r[s][n]["reward"] for r in per_seed]) for s in line]
                 for n in names]
    forgot = [d for d in domains if np.mean(forget[d]) > 0.02]
    rec_frac = {d: float(np.mean(recover[d]) / np.mean(forget[d])) for d in forgot}
    last_domains = list(dict(c.stages)[last])
    keep_last = {d: float(np.mean(keep[d])) for d in last_domains}
    claims = [
        {"claim": "cross-stage OPD recovers >= 90% of what later stages made the model forget",
         "pass": bool(forgot) and all(v >= 0.9 for v in rec_frac.values()),
         "measured": ", ".join(f"{d}: {v:.0%}" for d, v in rec_frac.items()) or
                     "no domain lost more than 0.02 reward (nothing to recover)"},
        {"claim": f"while keeping >= 95% of the last stage ({last})'s skill",
         "pass": all(v >= 0.95 for v in keep_last.values()),
         "measured": ", ".join(f"{d}: {v:.1%}" for d, v in keep_last.items())},
    ]
    results = {"recipe": "glm", "seeds": list(seeds), "stages": line,
               "per_seed": per_seed, "forgetting": forget, "recovery": recover,
               "claims": claims}
    rp.write_json(os.path.join(workdir, "results.json"), results)
    per_turn = [d for d in domains if PER_TURN in domain_modes(c, d)]
    md = [f"# glm results ({len(seeds)} seed(s): {list(seeds)})", "",
          f"Held-out reward per domain (mean over its thinking modes: on, off"
          + (f", and per-turn mixed on {', '.join(per_turn)}" if per_turn else "")
          + f"; greedy, n={c.eval.n} per cell, difficulty {c.eval.difficulty}) after every "
          f"stage; mean ± std over seeds. Forgotten = teacher stage - {last}; recovered = "
          f"student - {last}.", "",
          rp.markdown_table(["domain", *line, "forgotten", "recovered"], table), "",
          "Per thinking mode (think_on / think_off: one mode per prompt; think_mixed: the "
          "mode switched per assistant turn by the task's schedule, a turn that disobeys "
          "its mode scores the episode 0):", "",
          rp.markdown_table(["cell", *line], mode_rows), "",
          "## Claims", ""]
    md += [f"- **{'PASS' if cl['pass'] else 'FAIL'}** {cl['claim']}: {cl['measured']}"
           for cl in claims]
    md += ["", "![stages](stages.png)", ""]
    with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    points = line[:-1]
    plot_seed_lines(os.path.join(workdir, "stages.png"), [s.replace("_", " ") for s in points],
                    {d: [[dom(r, s, d) for s in points] for r in per_seed] for d in domains},
                    title="glm: forgetting across RL stages, recovery by cross-stage OPD")
    return results
