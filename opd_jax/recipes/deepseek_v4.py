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

import json
import os

import ml_collections

from opd_jax import envs
from opd_jax.recipes import report as rp
from opd_jax.recipes.kimi_k3 import specialist_start, stage_config, teacher_root
from opd_jax.recipes.pipeline import Stage


def _cells(c) -> dict[str, tuple[str, str, str]]:
    """specialist key -> (domain, family, effort)."""
    out = {}
    for key, (domain, effort) in c.specialists.items():
        if domain not in c.domains:
            raise ValueError(f"specialist {key!r}: domain {domain!r} not in {sorted(c.domains)}")
        out[key] = (domain, c.domains[domain], effort)
    cells = [envs.cell_name(d, e) for d, _, e in out.values()]
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
    table = {envs.cell_name(d, e): key for key, (d, _, e) in spec.items()}
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


# results.json's models per cell: the SFT start, the cell's specialist, the full-vocabulary
# student, the sampled-token student (same rollouts and steps) and the merged specialists.
MODELS = ("sft", "teacher", "student", "sampled_student", "merge")


def collect(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    """Evaluate every seed's models into results.json's dict (`report.report` adds the
    claims and the provenance).

    Every model is evaluated greedily on the same held-out problems, so differences are
    paired per problem (pooled over seeds).
    """
    spec = _cells(c)
    cells = list(spec.values())
    names = [envs.cell_name(d, e) for d, _, e in cells]
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        ev = lambda stage, cs: rp.evaluate_stage(sw, stage, cs, c.eval, tokenizer=tokenizer,
                                                 difficulty=c.eval.difficulty)
        r = {k: ev(k, cells) for k in MODELS if k != "teacher"}
        r["teacher"] = {}
        for key, cell in spec.items():
            r["teacher"].update(ev(f"spec_{key}", [cell]))
        with open(os.path.join(sw, "student", "teacher_cache.json"), encoding="utf-8") as f:
            r["cache"] = json.load(f)["stats"]
        r["curves"] = {n: {s: rp.curve(sw, s, f"heldout/{n}/reward")
                           for s in ("student", "sampled_student")} for n in names}
        per_seed.append(r)
    out = {n: {"specialist": key} | {k: [{"reward": r[k][n]["reward"],
                                           "rewards": r[k][n]["rewards"]} for r in per_seed]
                                      for k in MODELS}
           for key, n in zip(spec, names)}
    return {"recipe": "deepseek_v4", "seeds": list(seeds),
            "eval": rp.eval_meta(c.eval),
            "cells": out, "teacher_cache": [r["cache"] for r in per_seed],
            "max_loaded": c.student.teachers.max_loaded,
            "curves": [r["curves"] for r in per_seed]}


def plot(c: ml_collections.ConfigDict, workdir: str, results: dict) -> None:
    """curves.png: the first seed's full-vocab and sampled-token students' held-out reward
    per cell against its specialist and the merge."""
    curves, cells, seed = results["curves"][0], results["cells"], results["seeds"][0]
    rp.plot_curves(os.path.join(workdir, "curves.png"), {
        n: [{"x": curves[n]["student"][0], "y": curves[n]["student"][1],
             "label": "full-vocab OPD"},
            {"x": curves[n]["sampled_student"][0],
             "y": curves[n]["sampled_student"][1], "label": "sampled-token OPD"},
            {"y": cells[n]["teacher"][0]["reward"], "label": "specialist", "color": "k"},
            {"y": cells[n]["merge"][0]["reward"], "label": "merged", "color": "r"}]
        for n in cells}, title=f"deepseek_v4: held-out reward per cell (seed {seed})")


def _rewards(v: dict, k: str) -> list[float]:
    return [r["reward"] for r in v[k]]


def _pooled(v: dict, k: str) -> list[float]:
    return [x for r in v[k] for x in r["rewards"]]


def _retention(v: dict, k: str) -> list[float]:
    return [rp.ratio(a, b) for a, b in zip(_rewards(v, k), _rewards(v, "teacher"))]


def claims(results: dict) -> list[dict]:
    """The recipe's claims, from a results.json dict alone."""
    cells = results["cells"]
    n = len(cells)
    gain = {k: rp.paired(_pooled(v, "teacher"), _pooled(v, "sft")) for k, v in cells.items()}
    ret = {k: rp.finite_mean(_retention(v, "student")) for k, v in cells.items()}
    worst = min(ret, key=ret.get)
    vs_merge = {k: rp.paired(_pooled(v, "student"), _pooled(v, "merge")) for k, v in cells.items()}
    vs_sampled = {k: rp.paired(_pooled(v, "student"), _pooled(v, "sampled_student"))
                  for k, v in cells.items()}
    return [
        {"claim": "each specialist beats the SFT start on its cell beyond 2 standard errors "
                  "(paired over the same held-out problems, pooled over seeds)",
         "pass": all(p["diff"] > 2 * p["se"] for p in gain.values()),
         "measured": rp.paired_list(gain)},
        {"claim": "the full-vocabulary student keeps >= 95% of every specialist's reward",
         "pass": ret[worst] >= 0.95,
         "measured": f"mean {rp.finite_mean(list(ret.values())):.1%}, worst {worst} "
                     f"{ret[worst]:.1%}"},
        {"claim": f"the full-vocabulary student beats the merged specialists on every cell "
                  f"({n} of {n})",
         "pass": all(p["diff"] > 0 for p in vs_merge.values()),
         "measured": rp.paired_list(vs_merge)},
        {"claim": "the full-vocabulary student beats the sampled-token one (same rollouts and "
                  f"optimizer steps) on most cells (> {n // 2} of {n})",
         "pass": sum(p["diff"] > 0 for p in vs_sampled.values()) > n // 2,
         "measured": rp.paired_list(vs_sampled)},
    ]


def write_markdown(path: str, results: dict) -> None:
    """results.md from a results.json dict (so the committed table can be regenerated)."""
    seeds, meta, ev, cells = (results["seeds"], results["provenance"], results["eval"],
                              results["cells"])
    rows = [[n, v["specialist"], rp.fmt(_rewards(v, "sft")), rp.fmt(_rewards(v, "teacher")),
             rp.fmt(_rewards(v, "student")), rp.fmt(_retention(v, "student"), True),
             rp.fmt(_rewards(v, "sampled_student")), rp.fmt(_retention(v, "sampled_student"), True),
             rp.fmt(_rewards(v, "merge"))] for n, v in cells.items()]
    cache = results["teacher_cache"][0]
    md = [f"# deepseek_v4 results ({len(seeds)} seed(s): {list(seeds)})", "",
          rp.provenance_line(meta), "",
          f"Held-out reward (eval split, greedy, n={ev['n']} per cell and seed, difficulty "
          f"{ev['difficulty']}); mean ± std over seeds. Retention = student / specialist "
          f"reward on the specialist's cell. {len(cells)} specialists, teacher cache of "
          f"{results['max_loaded']}: {cache['loads']} loads, {cache['evictions']} evictions, "
          f"{cache['hits']} hits (seed {seeds[0]}).", "",
          rp.markdown_table(["cell", "specialist", "SFT", "teacher", "full-vocab OPD",
                             "retention", "sampled-token OPD", "retention", "merged"], rows),
          "", "## Claims", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", "![curves](curves.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
