"""Kimi K3: SFT cold start -> one GRPO teacher per (domain, effort) -> MOPD into one student.

Efforts follow Kimi's ladder: each domain's max-effort teacher is trained first (from the
SFT cold start), then high and low are derived by *budget annealing* — RL continues from the
next-higher effort's teacher with the smaller thinking budget and stronger length penalty of
the lower effort. ``effort_schedule="plain"`` trains every effort from SFT directly instead,
and ``"both"`` trains both ladders and reports the plain teachers next to the annealed ones.
The student starts from the SFT checkpoint and distills every cell's teacher (routed per
sample by (domain, effort)) with the clipped sampled-token signal; the baseline merges the
teachers' weights (task arithmetic on the SFT base). With ``c.teacher_sft`` (the scale-up
presets: larger teachers than the student) the teachers start from their own SFT stage
"teacher_sft" instead, which is also the merge's base.
"""
from __future__ import annotations

import os

import ml_collections
import numpy as np

from opd_jax import envs
from opd_jax.recipes import report as rp
from opd_jax.recipes.pipeline import Stage, read_done

LADDER = ("max", "high", "low")     # annealing order: each from the previous one
# The teacher level (fraction of a teacher's reward) of results.json files written before
# they recorded it: every preset's ``c.teacher_level``.
TEACHER_LEVEL = 0.95


def teacher_name(domain: str, effort: str, plain: bool = False) -> str:
    return f"{'plain' if plain else 'rl'}_{domain}_{effort}"


def stage_config(cfg: ml_collections.ConfigDict, seed: int, families: dict,
                 efforts, cells=()) -> ml_collections.ConfigDict:
    """A copy of a trainer config for one stage: its seed, task families and efforts
    (`cells`: only these "domain/effort" cells of the grid; empty: the config's own)."""
    c = ml_collections.ConfigDict(cfg.to_dict())
    c.seed = seed
    tasks = c.data.tasks if "data" in c else c.tasks
    tasks.families = dict(families)
    tasks.efforts = tuple(efforts)
    if cells:
        tasks.cells = tuple(cells)
    tasks.seed = seed
    return c


def build(c: ml_collections.ConfigDict, seed: int) -> list[Stage]:
    domains, efforts = dict(c.domains), tuple(c.efforts)
    unknown = sorted(set(efforts) - set(LADDER))
    if unknown:
        raise ValueError(f"kimi_k3 efforts {unknown}: expected a subset of {LADDER}")
    stages = [Stage("sft", "sft", stage_config(c.sft, seed, domains, efforts))]
    root = teacher_root(c, stages, seed, domains, efforts)
    ladder = [e for e in LADDER if e in efforts]
    teachers = {}
    for domain, fam in domains.items():
        prev = root
        for i, effort in enumerate(ladder):
            if c.effort_schedule in ("anneal", "both"):
                if i == 0:   # the ladder's top: its own SFT on the cell first, if configured
                    prev = specialist_start(c, stages, seed, f"sft_{domain}_{effort}",
                                            {domain: fam}, (effort,), root)
                name = teacher_name(domain, effort)
                stages.append(Stage(name, "grpo", stage_config(c.teacher, seed, {domain: fam}, (effort,)),
                                    init_from=prev))
                prev = name
                teachers[envs.cell_name(domain, effort)] = name
            if c.effort_schedule in ("plain", "both"):
                name = teacher_name(domain, effort, plain=True)
                start = specialist_start(c, stages, seed, f"sft_plain_{domain}_{effort}",
                                         {domain: fam}, (effort,), root)
                stages.append(Stage(name, "grpo", stage_config(c.teacher, seed, {domain: fam}, (effort,)),
                                    init_from=start))
                teachers.setdefault(envs.cell_name(domain, effort), name)
    if c.effort_schedule not in ("anneal", "plain", "both"):
        raise ValueError(f"effort_schedule={c.effort_schedule!r}: expected anneal, plain, both")
    stages.append(Stage("student", "opd", stage_config(c.student, seed, domains, efforts),
                        init_from="sft", teachers=teachers))
    stages.append(Stage("merge", "merge", ml_collections.ConfigDict(dict(c.merge)),
                        init_from=root, teachers=teachers))
    return stages


def teacher_root(c: ml_collections.ConfigDict, stages: list[Stage], seed: int, domains: dict,
                 efforts) -> str:
    """The stage teachers' RL starts from: "sft", or "teacher_sft" when `c.teacher_sft` exists.

    `c.teacher_sft` (optional) is a separate cold start for teachers of another size than the
    student (the scale-up presets: Qwen3-8B teachers, a Qwen3-1.7B student); it is appended
    to `stages` on the same data as the student's SFT, and the weight-merge baseline uses it
    as its base (task arithmetic needs the teachers' own starting point).
    """
    if "teacher_sft" not in c:
        return "sft"
    stages.append(Stage("teacher_sft", "sft", stage_config(c.teacher_sft, seed, domains, efforts)))
    return "teacher_sft"


def specialist_start(c: ml_collections.ConfigDict, stages: list[Stage], seed: int, name: str,
                     families: dict, efforts, start: str, cells=()) -> str:
    """Where a teacher's RL starts: `start`, or a specialist SFT stage `name` on its cells.

    With ``c.specialist_sft.train.steps > 0`` (every teacher gets its own SFT cold start, then RL),
    stage `name` fine-tunes `start` on the demos of `families` x `efforts` alone and is
    appended to `stages`; the caller starts the teacher's GRPO from it. At toy scale this is
    what makes a teacher better than the shared cold start: 20-40 GRPO iterations alone do
    not (measured: see experiments/kimi_k3/README.md). Used by all three recipes.
    """
    spec = c.get("specialist_sft")
    if spec is None or not spec.train.steps:
        return start
    stages.append(Stage(name, "sft", stage_config(spec, seed, families, efforts, cells),
                        init_from=start))
    return name


def routed_teachers(stages: list[Stage]) -> dict[str, str]:
    """cell -> teacher stage, as the student saw them."""
    return dict(next(s for s in stages if s.name == "student").teachers)


def rl_steps_to(stages: list[Stage], name: str, records: dict) -> int:
    """Optimizer steps on the way to teacher `name` from the shared cold start: its whole
    annealing chain of GRPO stages and its specialist SFT, if any."""
    by = {s.name: s for s in stages}
    steps, s = 0, by[name]
    while s.init_from is not None:
        steps += records[s.name]["optimizer_steps"]
        s = by[s.init_from]
    return steps


def collect(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    """Evaluate every seed's stages into results.json's dict (`report.report` adds the
    claims and the provenance, which results.json keeps after the seeds).

    Every model is evaluated greedily on the same held-out problems (the eval split, drawn
    by ``c.eval.seed``), so teacher - SFT differences are paired per problem.
    """
    domains, efforts = dict(c.domains), tuple(c.efforts)
    cells = [(d, fam, e) for d, fam in domains.items() for e in efforts]
    names = [envs.cell_name(d, e) for d, _, e in cells]
    ev, diff = c.eval, c.eval.difficulty
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        stages = build(c, seed)
        records = {s.name: read_done(sw, s.name) for s in stages}
        routed = routed_teachers(stages)
        evs = lambda stage, cs: rp.evaluate_stage(sw, stage, cs, ev, tokenizer=tokenizer,
                                                  difficulty=diff)
        r = {"teacher": {}, "plain": {}, "student": evs("student", cells),
             "merge": evs("merge", cells), "sft": evs("sft", cells), "opd_steps": {},
             "rl_steps": {}}
        for cell, (d, fam, e) in zip(names, cells):
            t = routed[cell]
            r["teacher"][cell] = evs(t, [(d, fam, e)])[cell]
            if c.effort_schedule == "both":
                r["plain"][cell] = evs(teacher_name(d, e, plain=True), [(d, fam, e)])[cell]
            r["rl_steps"][cell] = rl_steps_to(stages, t, records)
            xs, ys = rp.curve(sw, "student", f"heldout/{cell}/reward")
            level = c.teacher_level * r["teacher"][cell]["reward"]
            hit = next((x for x, y in zip(xs, ys) if y >= level), None)
            per_it = c.student.rl.ppo_epochs * c.student.rl.minibatches
            r["opd_steps"][cell] = None if hit is None else hit * per_it
        per_seed.append(r)

    def vals(kind, cell, key="reward"):
        return [s[kind][cell][key] for s in per_seed]

    def pooled(kind, cell):        # per-problem rewards of every seed, in one paired order
        return [x for s in per_seed for x in s[kind][cell]["rewards"]]

    out_cells = {}
    for cell in names:
        ret = [rp.ratio(s["student"][cell]["reward"], s["teacher"][cell]["reward"])
               for s in per_seed]
        mret = [rp.ratio(s["merge"][cell]["reward"], s["teacher"][cell]["reward"])
                for s in per_seed]
        opd = [s["opd_steps"][cell] for s in per_seed]
        rl = [s["rl_steps"][cell] for s in per_seed]
        out_cells[cell] = {
            "teacher": vals("teacher", cell), "student": vals("student", cell),
            "merge": vals("merge", cell), "sft": vals("sft", cell), "retention": ret,
            "merge_retention": mret, "teacher_len": vals("teacher", cell, "length"),
            "student_len": vals("student", cell, "length"),
            "teacher_minus_sft": rp.paired(pooled("teacher", cell), pooled("sft", cell)),
            "student_minus_merge": rp.paired(pooled("student", cell), pooled("merge", cell)),
            "plain": vals("plain", cell) if c.effort_schedule == "both" else [],
            "opd_steps": opd, "rl_steps": rl}
    return {"recipe": "kimi_k3", "seeds": list(seeds), "provenance": None,
            "eval": rp.eval_meta(ev), "teacher_level": c.teacher_level, "cells": out_cells}


def plot(c: ml_collections.ConfigDict, workdir: str, results: dict) -> None:
    """curves.png (the first seed's student held-out reward per cell against its teacher,
    the merge and the SFT start) and retention.png (student and merge / teacher)."""
    out_cells, seed, n = results["cells"], results["seeds"][0], results["eval"]["n"]
    names = list(out_cells)
    sw = os.path.join(workdir, f"seed{seed}")
    curves = {}
    for cell in names:
        xs, ys = rp.curve(sw, "student", f"heldout/{cell}/reward")
        v = out_cells[cell]
        curves[cell] = [{"x": xs, "y": ys,
                         "label": f"student (MOPD), in-run eval n={c.student.eval.n}"},
                        {"y": v["teacher"][0], "label": f"teacher (n={n})", "color": "k"},
                        {"y": v["merge"][0], "label": f"merged (n={n})", "color": "r"},
                        {"y": v["sft"][0], "label": f"SFT start (n={n})", "color": "gray"}]
    rp.plot_curves(os.path.join(workdir, "curves.png"), curves,
                   title=f"kimi_k3: student held-out reward per cell (seed {seed})")
    rp.plot_bars(os.path.join(workdir, "retention.png"), names, {
        "student / teacher": [np.mean(out_cells[c_]["retention"]) for c_ in names],
        "merged / teacher": [np.mean(out_cells[c_]["merge_retention"]) for c_ in names]},
        errors={"student / teacher": [np.std(out_cells[c_]["retention"]) for c_ in names],
                "merged / teacher": [np.std(out_cells[c_]["merge_retention"]) for c_ in names]},
        title="kimi_k3: retention of teacher reward", ylabel="fraction of teacher reward",
        hline=1.0)


def write_markdown(path: str, results: dict) -> None:
    """results.md from a results.json dict (so the committed table can be regenerated)."""
    cells, seeds, meta, ev = (results["cells"], results["seeds"], results["provenance"],
                              results["eval"])
    header = ["cell", "SFT", "teacher", "teacher - SFT (se, paired)", "student (MOPD)",
              "retention", "merged", "plain teacher", "length T / S",
              "OPD steps to teacher level vs the teacher's (SFT + RL) steps"]
    rows = []
    for cell, v in cells.items():
        tms = v["teacher_minus_sft"]
        rows.append([cell, rp.fmt(v["sft"]), rp.fmt(v["teacher"]),
                     f"{tms['diff']:+.3f} ({tms['se']:.3f})", rp.fmt(v["student"]),
                     rp.fmt(v["retention"], pct=True), rp.fmt(v["merge"]),
                     rp.fmt(v["plain"]) if v["plain"] else "-",
                     f"{np.mean(v['teacher_len']):.1f} / {np.mean(v['student_len']):.1f}",
                     "/".join("-" if o is None else str(o) for o in v["opd_steps"])
                     + f" vs {v['rl_steps'][0]}"])
    md = [f"# kimi_k3 results ({len(seeds)} seed(s): {list(seeds)})", "",
          rp.provenance_line(meta), "",
          f"Held-out reward (eval split, greedy, n={ev['n']} per cell and seed, difficulty "
          f"{ev['difficulty']}); mean ± std over seeds. Retention = student / teacher reward "
          f"on the teacher's cell. teacher - SFT: paired over the same problems, pooled over "
          f"seeds.", "", rp.markdown_table(header, rows), "", "## Claims", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", "![curves](curves.png)", "", "![retention](retention.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))


def merge_reason(cells: dict, better: list, n: int) -> str:
    """The measured reason behind the merge comparison, from the same cells. A merge adds the
    teachers' task vectors to the SFT start and OPD copies the teachers: where the teachers
    gained nothing over the start, the student inherits what they lost and the merge, near
    the start, does not."""
    m = lambda key: float(np.mean([np.mean(v[key]) for v in cells.values()]))
    t_sft = float(np.mean([v["teacher_minus_sft"]["diff"] for v in cells.values()]))
    return (f"; measured reason: the teachers beat the SFT start on {len(better)} of {n} cells "
            f"(mean teacher - SFT {t_sft:+.3f}), the student copies them (mean retention "
            f"{m('retention'):.1%}) and the merge stays near the start (mean merge - SFT "
            f"{m('merge') - m('sft'):+.3f}; {m('merge_retention'):.1%} of the teachers' "
            f"reward)")


def _grid(cells: dict) -> tuple[list[str], list[str]]:
    """(domains, efforts) of results.json's cells, in the order the report wrote them (the
    cells are `envs.cell_name(domain, effort)`, domain by domain)."""
    pairs = [name.split("/", 1) for name in cells]
    return list(dict.fromkeys(d for d, _ in pairs)), list(dict.fromkeys(e for _, e in pairs))


def claims(results: dict) -> list[dict]:
    """The recipe's claims, from a results.json dict alone (paired over the same problems)."""
    cells = results["cells"]
    domains, efforts = _grid(cells)
    lvl = results.get("teacher_level", TEACHER_LEVEL)
    ret = {k: float(np.mean(v["retention"])) for k, v in cells.items()}
    mean_ret = float(np.mean(list(ret.values())))
    worst = min(ret, key=ret.get)
    beats = [k for k, v in cells.items() if np.mean(v["student"]) > np.mean(v["merge"])]
    # Teacher-level speed is only measurable where the SFT start is below the level: where
    # it already holds it, "reaching" it takes no training and says nothing about OPD.
    measurable = [k for k, v in cells.items() if np.mean(v["sft"]) < lvl * np.mean(v["teacher"])]
    fast_ok = [k for k in measurable
               if all(x is not None and x * 5 <= y
                      for x, y in zip(cells[k]["opd_steps"], cells[k]["rl_steps"]))]
    gain = {k: v["teacher_minus_sft"] for k, v in cells.items()}
    better = [k for k, g in gain.items() if g["diff"] > 2 * g["se"]]
    weakest = min(gain, key=lambda k: gain[k]["diff"] - 2 * gain[k]["se"])
    n = len(cells)
    out = [
        {"claim": "each teacher beats the SFT start on its cell beyond 2 standard errors "
                  "(paired over the same held-out problems, pooled over seeds)",
         "pass": len(better) == n,
         "measured": f"{len(better)} of {n}; weakest {weakest} "
                     f"{gain[weakest]['diff']:+.3f} (se {gain[weakest]['se']:.3f})"},
        {"claim": "the student keeps >= 90% of every teacher's reward (goal: 95% mean)",
         "pass": ret[worst] >= 0.90,
         "measured": f"mean {mean_ret:.1%}, worst {worst} {ret[worst]:.1%}"},
        {"claim": f"the student beats the task-arithmetic merge on most cells (> {n // 2} "
                  f"of {n})",
         "pass": len(beats) > n // 2, "measured": f"{len(beats)} of {n}"
                                                    + merge_reason(cells, better, n)},
        {"claim": f"OPD reaches {lvl:.0%} of teacher level in <= 1/5 of the "
                  "optimizer steps the teacher took from the shared cold start (its "
                  "specialist SFT and RL), every seed",
         "pass": bool(measurable) and len(fast_ok) == len(measurable),
         "measured": f"{len(fast_ok)} of {len(measurable)} measurable cells"
                     + (f" ({n - len(measurable)} of {n} not measurable: the SFT start already "
                        f"holds {lvl:.0%} of the teacher's reward)" if len(measurable) < n
                        else "")},
    ]
    ladder = [e for e in ("max", "high", "low") if e in efforts]
    for who in ("teacher", "student"):
        for d in domains:
            m = [float(np.mean(cells[envs.cell_name(d, e)][who])) for e in ladder]
            out.append({"claim": f"effort axis ({who}, {d}): {' > '.join(ladder)} at the "
                                 f"evaluation difficulty",
                        "pass": all(a > b for a, b in zip(m, m[1:])),
                        "measured": ", ".join(f"{e} {v:.3f}" for e, v in zip(ladder, m))})
    return out
