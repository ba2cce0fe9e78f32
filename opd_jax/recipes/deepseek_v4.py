"""DeepSeek-V4: a bank of specialists -> weighted full-vocabulary reverse-KL OPD.

Each specialist is GRPO from the shared SFT checkpoint on its own (domain, effort) cell (from
a separate "teacher_sft" stage when ``c.teacher_sft`` is set: specialists larger than the
student, as in the scale-up presets, which is then also the merge's base); efforts differ
by thinking budget (context window) and length penalty. The student
distills all of them at once through the fused reverse-KL kernel (teacher last-layer hidden
states cached per batch, logits recomputed chunk by chunk), with teachers loaded on demand
into an LRU cache smaller than the bank (loads and evictions are logged to
``student/teacher_cache.json``). Baselines in the same table: a sampled-token OPD student
(Kimi's clipped signal) with the same rollouts and optimizer steps, and the weight-merged
specialists.
"""
from __future__ import annotations

import os

import ml_collections
import numpy as np

from opd_jax.recipes.kimi_k3 import specialist_start, stage_config, teacher_root
from opd_jax.recipes.pipeline import Stage


def _cells(c) -> dict[str, tuple[str, str, str]]:
    """specialist key -> (domain, family, effort)."""
    out = {}
    for key, (domain, effort) in c.specialists.items():
        if domain not in c.domains:
            raise ValueError(f"specialist {key!r}: domain {domain!r} not in {sorted(c.domains)}")
        out[key] = (domain, c.domains[domain], effort)
    cells = [f"{d}/{e}" for d, _, e in out.values()]
    if len(set(cells)) != len(cells):
        raise ValueError(f"two specialists share a (domain, effort) cell: {cells}")
    return out


def build(c: ml_collections.ConfigDict, seed: int) -> list[Stage]:
    spec = _cells(c)
    domains = dict(c.domains)
    efforts = tuple(dict.fromkeys(e for _, _, e in spec.values()))
    # The SFT cold start covers the full (domain x effort) grid the specialists come from.
    stages = [Stage("sft", "sft", stage_config(c.sft, seed, domains, efforts))]
    root = teacher_root(c, stages, seed, domains, efforts)   # "sft" unless c.teacher_sft
    for key, (d, fam, e) in spec.items():
        start = specialist_start(c, stages, seed, f"sft_{key}", {d: fam}, (e,), root)
        stages.append(Stage(f"spec_{key}", "grpo", stage_config(c.specialist, seed, {d: fam}, (e,)),
                            init_from=start))
    teachers = {key: f"spec_{key}" for key in spec}
    table = {f"{d}/{e}": key for key, (d, _, e) in spec.items()}
    for name, base_cfg in (("student", c.student), ("sampled_student", c.sampled_student)):
        s = stage_config(base_cfg, seed, domains, efforts)
        # Only the specialists' cells are trained: the grid's other cells have no teacher.
        s.tasks.cells = tuple(table)
        s.teachers.routing = "table"
        s.teachers.table = table
        stages.append(Stage(name, "opd", s, init_from="sft", teachers=teachers))
    stages.append(Stage("merge", "merge", ml_collections.ConfigDict(dict(c.merge)),
                        init_from=root, teachers=teachers))
    return stages


def report(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    import json

    from opd_jax.recipes import report as rp
    spec = _cells(c)
    cells = list(spec.values())
    names = [f"{d}/{e}" for d, _, e in cells]
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        ev = lambda stage, cs: rp.evaluate_stage(sw, stage, cs, c.eval, tokenizer=tokenizer,
                                                 difficulty=c.eval.difficulty)
        r = {k: ev(k, cells) for k in ("sft", "student", "sampled_student", "merge")}
        r["teacher"] = {}
        for key, cell in spec.items():
            r["teacher"].update(ev(f"spec_{key}", [cell]))
        with open(os.path.join(sw, "student", "teacher_cache.json"), encoding="utf-8") as f:
            r["cache"] = json.load(f)["stats"]
        r["curves"] = {n: {s: rp.curve(sw, s, f"heldout/{n}/reward")
                           for s in ("student", "sampled_student")} for n in names}
        per_seed.append(r)

    def vals(kind, n):
        return [r[kind][n]["reward"] for r in per_seed]

    rows, out = [], {}
    for key, n in zip(spec, names):
        t, fv, st, mg = (vals(k, n) for k in ("teacher", "student", "sampled_student", "merge"))
        ret = [rp.ratio(a, b) for a, b in zip(fv, t)]
        sret = [rp.ratio(a, b) for a, b in zip(st, t)]
        out[n] = {"specialist": key, "teacher": t, "full_vocab": fv, "sampled": st,
                  "merge": mg, "sft": vals("sft", n), "retention": ret,
                  "sampled_retention": sret}
        rows.append([n, key, rp.fmt(vals("sft", n)), rp.fmt(t), rp.fmt(fv), rp.fmt(ret, True),
                     rp.fmt(st), rp.fmt(sret, True), rp.fmt(mg)])
    dense_wins = sum(np.mean(v["full_vocab"]) > np.mean(v["sampled"]) for v in out.values())
    merge_wins = sum(np.mean(v["full_vocab"]) > np.mean(v["merge"]) for v in out.values())
    mean_ret = rp.finite_mean([np.mean(v["retention"]) for v in out.values()])
    cache = per_seed[0]["cache"]
    results = {"recipe": "deepseek_v4", "seeds": list(seeds), "cells": out,
               "teacher_cache": [r["cache"] for r in per_seed],
               "summary": {"full_vocab_beats_sampled": int(dense_wins),
                           "full_vocab_beats_merge": int(merge_wins),
                           "mean_retention": mean_ret}}
    rp.write_json(os.path.join(workdir, "results.json"), results)
    md = [f"# deepseek_v4 results ({len(seeds)} seed(s): {list(seeds)})", "",
          f"Held-out reward (greedy, n={c.eval.n} per cell, difficulty "
          f"{c.eval.difficulty}); mean ± std over seeds. {len(spec)} specialists, teacher "
          f"cache of {c.student.teachers.max_loaded}: {cache['loads']} loads, "
          f"{cache['evictions']} evictions, {cache['hits']} hits (seed {seeds[0]}).", "",
          rp.markdown_table(["cell", "specialist", "SFT", "teacher", "full-vocab OPD",
                             "retention", "sampled-token OPD", "retention", "merged"], rows),
          "", f"- full-vocabulary OPD beats sampled-token OPD (same rollouts and steps) on "
              f"{dense_wins} of {len(out)} cells",
          f"- full-vocabulary OPD beats the merged specialists on {merge_wins} of {len(out)} "
          f"cells", f"- mean retention of full-vocabulary OPD: {mean_ret:.1%}", "",
          "![curves](curves.png)", ""]
    with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    s0 = per_seed[0]
    rp.plot_curves(os.path.join(workdir, "curves.png"), {
        n: [{"x": s0["curves"][n]["student"][0], "y": s0["curves"][n]["student"][1],
             "label": "full-vocab OPD"},
            {"x": s0["curves"][n]["sampled_student"][0],
             "y": s0["curves"][n]["sampled_student"][1], "label": "sampled-token OPD"},
            {"y": s0["teacher"][n]["reward"], "label": "specialist", "color": "k"},
            {"y": s0["merge"][n]["reward"], "label": "merged", "color": "r"}]
        for n in names}, title=f"deepseek_v4: held-out reward per cell (seed {seeds[0]})")
    return results
