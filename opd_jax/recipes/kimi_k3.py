"""Kimi K3: specialists per domain (SFT, then GRPO down Kimi's effort ladder) -> MOPD into one
student, against the validation-tuned merge of the same teachers.

Stages of one seed:

1. ``sft`` (optional, ``c.sft.train.steps > 0``): a cold start on every domain's demos. With
   0 steps the start is the pretrained base itself (``c.start``), which is the testbed's
   setting: its base already knows the formats, and a cold start on the teacher cells'
   demos would spend the headroom the teachers are meant to fill.
2. Per domain, the specialist: ``sft_<domain>`` fine-tunes the start on its own domain's train
   demos (every effort), then GRPO at the top of the ladder (``rl_<domain>_max``) and
   *budget annealing* down it: high continues RL from max, low from high, each with its
   effort's smaller think budget (``effort_schedule="plain"`` trains every effort from the
   specialist SFT instead; ``"both"`` reports both). Each (domain, effort) cell's teacher is
   its rung of the ladder.
3. ``merge_<scale>``: task arithmetic of the cell teachers on the start, one stage per scale
   of ``c.merge_scales``; the report keeps the scale with the best pass rate on a validation
   draw of *train-split* problems (never the evaluation problems).
4. ``student``: MOPD, the teacher routed per sample by (domain, effort), the seed's clipped
   sampled-token signal; from the start, or (``c.student_from_merge``: a scale) from that
   merge, which already holds part of every teacher (measured: the student sweep).
5. ``sampled_student`` (optional, ``c.sampled_student``: deepseek_v4's baseline): a second
   student from the same point with another objective (the sampled-token signal beside a
   full-vocabulary student), compared with the student per cell, with both FLOP counts.
6. The mixed-data baseline (``c.mixed_rl_steps > 0``): one model trained on the union of the
   specialists' data by their own recipe, with no specialists: ``mixed_sft`` (SFT of the
   start on every domain's demos, the specialists' summed steps) then ``mixed`` (GRPO with
   the teachers' settings on every cell, ``c.mixed_rl_steps`` iterations, chosen so its
   compute matches the specialists' and the student's; the report prints both).

The report (`collect`, `claims`) reads pass rate (verifier correctness) only: the length
penalty stays in the training reward and in the reward columns, and no claim reads it. Every
seed is evaluated on its own draw of held-out problems (``c.eval.seed + seed``), so pooled
standard errors count problems. Claims, each paired per problem and pooled over seeds:

* PRECONDITION: the start has headroom on every teacher cell and every teacher gained;
  the cells where it fails are left out of the per-cell claims below, which are judged on
  the others and name the cells left out; when it fails on every cell, they print as not
  judged, with the numbers;
* every teacher beats the start on its cell by >= GAIN beyond 3 se;
* each domain's specialist (its max-effort teacher) loses >= LOSS on the other domain;
* effort binds in pass rate for teachers and student: max - high and high - low >= EFFORT_GAP;
* the student keeps the teachers' gains: (student - start) / (teacher - start) has mean >=
  0.9 and minimum >= 0.8 over cells;
* the student beats the validation-tuned merge beyond 2 se on every cell;
* with the mixed-data baseline: the student beats it beyond 2 se on every cell, its compute
  and the specialists' plus the student's printed beside;
* with ``sampled_student``: the student beats it beyond 2 se on every cell at equal compute;
* compute: on every cell the student first holds SPEED_SHARE of the teacher's gain (its
  in-run held-out evaluations, mean over seeds) having spent <= 1 / SPEED_RATIO of the FLOPs
  that cell's teacher spent on its path from the start (its specialist SFT and every GRPO
  rung it descends from, each once); the student is charged its whole OPD compute so far.

``deepseek_v4`` is this pipeline with a full-vocabulary student and the sampled-token one as
``sampled_student`` (its config says so); the report names the recipe from ``c.recipe``.
"""
from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from opd_jax import envs
from opd_jax.recipes import report as rp
from opd_jax.recipes.pipeline import Stage

LADDER = ("max", "high", "low")     # annealing order: each from the previous one
GAIN, GAIN_K = 0.15, 3.0            # every teacher beats the start by GAIN beyond GAIN_K se
LOSS, LOSS_K = 0.10, 2.0            # each specialist loses LOSS on the other domain
EFFORT_GAP = 0.10                   # max - high and high - low, in pass rate
RETENTION_MEAN, RETENTION_WORST = 0.9, 0.8
MERGE_K = 2.0                       # the student beats the merge beyond MERGE_K se
HEADROOM = 1.0 - GAIN               # the start's pass rate on a teacher cell stays below it
SPEED_SHARE, SPEED_RATIO = 0.9, 5.0  # the student holds 90% of a gain within 1/5 of its compute
SAMPLED = "sampled_student"          # the optional second student (module doc, 5)


def teacher_name(domain: str, effort: str, plain: bool = False) -> str:
    return f"{'plain' if plain else 'rl'}_{domain}_{effort}"


def merge_name(scale: float) -> str:
    return f"merge_{float(scale):g}"


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


def start_path(c: ml_collections.ConfigDict) -> str:
    """The checkpoint every line starts from when there is no cold-start stage."""
    return c.get("start") or c.sft.model.init_from


def build(c: ml_collections.ConfigDict, seed: int) -> list[Stage]:
    domains, efforts = dict(c.domains), tuple(c.efforts)
    unknown = sorted(set(efforts) - set(LADDER))
    if unknown:
        raise ValueError(f"kimi_k3 efforts {unknown}: expected a subset of {LADDER}")
    if c.effort_schedule not in ("anneal", "plain", "both"):
        raise ValueError(f"effort_schedule={c.effort_schedule!r}: expected anneal, plain, both")
    stages: list[Stage] = []
    if c.sft.train.steps:
        stages.append(Stage("sft", "sft", stage_config(c.sft, seed, domains, efforts)))
        start = "sft"
    else:
        start = None
    root = teacher_root(c, stages, seed, domains, efforts, start)
    ladder = [e for e in LADDER if e in efforts]
    teachers = {}
    for domain, fam in domains.items():
        spec = specialist_start(c, stages, seed, f"sft_{domain}", {domain: fam}, ladder, root)
        prev = spec
        for effort in ladder:
            if c.effort_schedule in ("anneal", "both"):
                name = teacher_name(domain, effort)
                stages.append(Stage(name, "grpo", stage_config(c.teacher, seed, {domain: fam},
                                                               (effort,)), init_from=prev))
                prev = name
                teachers[envs.cell_name(domain, effort)] = name
            if c.effort_schedule in ("plain", "both"):
                name = teacher_name(domain, effort, plain=True)
                stages.append(Stage(name, "grpo", stage_config(c.teacher, seed, {domain: fam},
                                                               (effort,)), init_from=spec))
                teachers.setdefault(envs.cell_name(domain, effort), name)
    for scale in c.merge_scales:
        cfg = dict(method=c.merge.method, scale=float(scale))
        if root is None:
            cfg["base"] = start_path(c)
        stages.append(Stage(merge_name(scale), "merge", ml_collections.ConfigDict(cfg),
                            init_from=root, teachers=teachers))
    # The student starts from the start, or from the merge of scale c.student_from_merge
    # (the merges come first so it exists; the report's baseline stays the merge its
    # validation draw picks).
    init = start
    from_merge = c.get("student_from_merge")
    if from_merge is not None:
        if float(from_merge) not in [float(s) for s in c.merge_scales]:
            raise ValueError(f"student_from_merge={from_merge}: expected one of merge_scales "
                             f"{tuple(c.merge_scales)}")
        init = merge_name(from_merge)
    stages.append(Stage("student", "opd", stage_config(c.student, seed, domains, efforts),
                        init_from=init, teachers=teachers))
    if "sampled_student" in c:
        stages.append(Stage(SAMPLED, "opd", stage_config(c.sampled_student, seed, domains,
                                                         efforts), init_from=init,
                            teachers=teachers))
    if c.get("mixed_rl_steps", 0):
        stages += mixed_stages(c, seed, start)
    return stages


MIXED = "mixed"      # the mixed-data baseline's final stage (its SFT: "mixed_sft")


def mixed_sft_config(c: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """SFT of the start on the union of the specialists' SFT data (every domain, every
    effort), with their summed steps and their settings."""
    domains = dict(c.domains)
    cfg = stage_config(c.specialist_sft, seed, domains, tuple(c.efforts))
    cfg.train.steps = cfg.train.ckpt_every = c.specialist_sft.train.steps * len(domains)
    return cfg


def mixed_stages(c: ml_collections.ConfigDict, seed: int, start: str | None) -> list[Stage]:
    """The mixed-data baseline (module doc, 5): ``mixed_sft`` (when the specialists have an
    SFT) then ``mixed``, GRPO on every cell for ``c.mixed_rl_steps`` iterations."""
    out, init = [], start
    spec = c.get("specialist_sft")
    if spec is not None and spec.train.steps:
        out.append(Stage("mixed_sft", "sft", mixed_sft_config(c, seed), init_from=start))
        init = "mixed_sft"
    rl = stage_config(c.teacher, seed, dict(c.domains), tuple(c.efforts))
    rl.train.steps = int(c.mixed_rl_steps)
    rl.train.ckpt_every = min(int(rl.train.ckpt_every), rl.train.steps)
    out.append(Stage(MIXED, "grpo", rl, init_from=init))
    return out


def teacher_root(c: ml_collections.ConfigDict, stages: list[Stage], seed: int, domains: dict,
                 efforts, start: str | None = "sft") -> str | None:
    """The stage teachers' training starts from: `start` (a stage, or None: the base), or
    "teacher_sft" when `c.teacher_sft` exists.

    `c.teacher_sft` (optional) is a separate cold start for teachers of another size than the
    student (the scale-up presets: Qwen3-8B teachers, a Qwen3-1.7B student); it is appended
    to `stages` on the same data as the student's SFT, and the weight-merge baseline uses it
    as its base (task arithmetic needs the teachers' own starting point).
    """
    if "teacher_sft" not in c:
        return start
    stages.append(Stage("teacher_sft", "sft", stage_config(c.teacher_sft, seed, domains, efforts)))
    return "teacher_sft"


def specialist_start(c: ml_collections.ConfigDict, stages: list[Stage], seed: int, name: str,
                     families: dict, efforts, start: str | None, cells=()) -> str | None:
    """Where a teacher's RL starts: `start`, or a specialist SFT stage `name` on its cells.

    With ``c.specialist_sft.train.steps > 0`` (every teacher gets its own SFT cold start, then RL),
    stage `name` fine-tunes `start` on the demos of `families` x `efforts` alone and is
    appended to `stages`; the caller starts the teacher's GRPO from it. At toy scale this is
    what makes a teacher better than the shared start: GRPO iterations alone do not
    (measured: see experiments/kimi_k3/README.md). Used by all three recipes.
    """
    spec = c.get("specialist_sft")
    if spec is None or not spec.train.steps:
        return start
    stages.append(Stage(name, "sft", stage_config(spec, seed, families, efforts, cells),
                        init_from=start))
    return name


def lineage(stages: list[Stage], name: str, start: str | None) -> list[str]:
    """Stage `name` and every stage it descends from (``init_from``), down to the shared
    `start` (excluded): what a teacher's training spent from the start."""
    by = {s.name: s for s in stages}
    out = []
    while name is not None and name != start:
        out.append(name)
        name = by[name].init_from
    return out


def routed_teachers(stages: list[Stage]) -> dict[str, str]:
    """cell -> teacher stage, as the student saw them."""
    return dict(next(s for s in stages if s.name == "student").teachers)


def eval_seed(c: ml_collections.ConfigDict, seed: int) -> int:
    """The held-out draw of a seed: its own problems (pooled standard errors count
    problems, not problem x seed pairs)."""
    return int(c.eval.seed) + int(seed)


def validation_seed(c: ml_collections.ConfigDict, seed: int) -> int:
    """The merge's validation draw of a seed (train split: disjoint from the evaluation)."""
    return int(c.eval.seed) + 1_000 + int(seed)


# -- evaluation ------------------------------------------------------------------------------
def merge_validation(c: ml_collections.ConfigDict, sw: str, stages: list[Stage], seed: int,
                     tokenizer) -> dict[str, float]:
    """{merge stage: mean pass rate over the cells} on the seed's validation draw (train
    split, `c.val_n` problems per cell); the report keeps the best."""
    cells = [(d, fam, e) for d, fam in dict(c.domains).items() for e in c.efforts]
    return {s.name: float(np.mean([r["pass_rate"] for r in rp.evaluate_stage(
        sw, s.name, cells, c.eval, tokenizer=tokenizer, difficulty=c.eval.difficulty,
        split="train", seed=validation_seed(c, seed), n=c.val_n).values()]))
        for s in stages if s.kind == "merge"}


def collect(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    """Evaluate every seed's models into results.json's dict (`report.report` adds the
    claims and the provenance).

    Per seed: the start, the student and the chosen merge on every cell; each cell's teacher
    on its cell; each domain's specialist (its max-effort teacher) on the other domains'
    cells; every merge scale on the validation draw. Values are per-problem pass (0/1) and
    reward lists, so every comparison is paired per problem."""
    domains, efforts = dict(c.domains), tuple(c.efforts)
    cells = [(d, fam, e) for d, fam in domains.items() for e in efforts]
    names = [envs.cell_name(d, e) for d, _, e in cells]
    top = next(e for e in LADDER if e in efforts)
    ev, diff = c.eval, c.eval.difficulty
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        stages = build(c, seed)
        routed = routed_teachers(stages)
        es, vs = eval_seed(c, seed), validation_seed(c, seed)

        def evs(stage, cs, path=None):
            return rp.evaluate_stage(sw, stage, cs, ev, tokenizer=tokenizer, difficulty=diff,
                                     path=path, seed=es, n=ev.n)
        start = stages[0].name if stages and stages[0].name == "sft" else None
        models = {"start": evs(start or "start", cells,
                               path=None if start else start_path(c)),
                  "student": evs("student", cells)}
        val = merge_validation(c, sw, stages, seed, tokenizer)
        best = max(val, key=val.get)
        models["merge"] = evs(best, cells)
        for extra in (MIXED, SAMPLED):
            if any(s.name == extra for s in stages):
                models[extra] = evs(extra, cells)
        teacher = {cell: evs(routed[cell], [(d, fam, e)])[cell]
                   for cell, (d, fam, e) in zip(names, cells)}
        plain = ({cell: evs(teacher_name(d, e, plain=True), [(d, fam, e)])[cell]
                  for cell, (d, fam, e) in zip(names, cells)}
                 if c.effort_schedule == "both" else {})
        specialists = {d: evs(routed[envs.cell_name(d, top)],
                              [(o, ofam, top) for o, ofam in domains.items() if o != d])
                       for d in domains}
        keep = ("pass_rate", "reward", "length", "passes", "rewards", "n")
        trim = lambda rows: {k: {f: r[f] for f in keep} for k, r in rows.items()}
        students = [n for n in ("student", SAMPLED) if n in models]
        extra = {"curves": {n: {cell: rp.curve(sw, n, f"heldout/{cell}/pass_rate")
                                for cell in names} for n in students},
                 "paths": {cell: lineage(stages, routed[cell], start) for cell in names}}
        cache = os.path.join(sw, "student", "teacher_cache.json")
        if os.path.isfile(cache):
            with open(cache, encoding="utf-8") as f:
                extra["teacher_cache"] = json.load(f)["stats"]
        per_seed.append(extra | {
            "seed": seed, "eval_seed": es, "validation_seed": vs,
            "models": {k: trim(v) for k, v in models.items()}, "teacher": trim(teacher),
            "plain": trim(plain), "specialist": {d: trim(v) for d, v in specialists.items()},
            "merge_validation": val, "merge_chosen": best,
            "teachers": {cell: routed[cell] for cell in names},
            "stages": {s.name: rp.stage_cost(sw, s) for s in stages}})
    return {"recipe": c.recipe, "seeds": list(seeds), "provenance": None,
            "eval": rp.eval_meta(ev) | {"per_seed_problems": True},
            "domains": domains, "efforts": list(efforts), "top": top,
            "table": table(per_seed, names, domains, efforts, top), "per_seed": per_seed}


def _pooled(per_seed, getter, key="passes") -> list[float]:
    return [x for s in per_seed for x in getter(s)[key]]


def table(per_seed: list[dict], names: list[str], domains: dict, efforts, top: str) -> dict:
    """Pooled over seeds (each seed its own problems): pass rates and every paired
    comparison the claims read."""
    model = lambda m, cell: (lambda s: s["models"][m][cell])
    teach = lambda cell: (lambda s: s["teacher"][cell])
    out = {"pass": {}, "reward": {}, "length": {}, "vs_start": {}, "student_vs_merge": {},
           "retention": {}, "merge_retention": {}, "competition": {}, "effort": {}}
    for cell in names:
        get = {"start": model("start", cell), "teacher": teach(cell),
               "student": model("student", cell), "merge": model("merge", cell)}
        if per_seed[0]["plain"]:
            get["plain"] = lambda s, cell=cell: s["plain"][cell]
        for extra, key in ((MIXED, "student_vs_mixed"), (SAMPLED, "student_vs_sampled")):
            if extra in per_seed[0]["models"]:
                get[extra] = model(extra, cell)
                out.setdefault(key, {})[cell] = rp.paired(
                    _pooled(per_seed, get["student"]), _pooled(per_seed, get[extra]))
        out["pass"][cell] = {m: float(np.mean(_pooled(per_seed, g))) for m, g in get.items()}
        out["reward"][cell] = {m: float(np.mean(_pooled(per_seed, g, "rewards")))
                               for m, g in get.items()}
        out["length"][cell] = {m: float(np.mean([g(s)["length"] for s in per_seed]))
                               for m, g in get.items()}
        start = _pooled(per_seed, get["start"])
        out["vs_start"][cell] = {m: rp.paired(_pooled(per_seed, g), start)
                                 for m, g in get.items() if m != "start"}
        out["student_vs_merge"][cell] = rp.paired(_pooled(per_seed, get["student"]),
                                                  _pooled(per_seed, get["merge"]))
        gain = out["vs_start"][cell]["teacher"]["diff"]
        # Retention of the gain, defined where the teacher beats the start.
        for who, key in (("student", "retention"), ("merge", "merge_retention"),
                         (SAMPLED, "sampled_retention")):
            if who in get:
                out.setdefault(key, {})[cell] = (out["vs_start"][cell][who]["diff"] / gain
                                                 if gain > 0 else float("nan"))
    for d in domains:
        for o, ofam in domains.items():
            if o == d:
                continue
            cell = envs.cell_name(o, top)
            spec = _pooled(per_seed, lambda s: s["specialist"][d][cell])
            out["competition"][f"{d} on {o}"] = rp.paired(
                _pooled(per_seed, model("start", cell)), spec)   # start - specialist: its loss
    ladder = [e for e in LADDER if e in efforts]
    for who in ("start", "teacher", "student"):
        for d in domains:
            get = (lambda e: teach(envs.cell_name(d, e))) if who == "teacher" else \
                (lambda e: model(who, envs.cell_name(d, e)))
            out["effort"][f"{who} {d}"] = {
                f"{a}-{b}": rp.paired(_pooled(per_seed, get(a)), _pooled(per_seed, get(b)))
                for a, b in zip(ladder, ladder[1:])}
    return out


# -- claims ----------------------------------------------------------------------------------
def precondition(results: dict) -> dict:
    """The start has headroom on every teacher cell (pass rate < HEADROOM) and every teacher
    gained on its cell (beyond 2 se): without both, no claim below says anything about OPD
    on that cell. ``left_out`` (only when some fail): the cells that fail it."""
    t = results["table"]
    start = {cell: v["start"] for cell, v in t["pass"].items()}
    gain = {cell: v["teacher"] for cell, v in t["vs_start"].items()}
    full = [cell for cell, p in start.items() if p >= HEADROOM]
    flat = [cell for cell, g in gain.items() if not rp.beats(g, 0.0, 2.0)]
    left = [cell for cell in start if cell in full or cell in flat]
    return {"claim": f"PRECONDITION: the start has headroom on every teacher cell (pass rate "
                     f"< {HEADROOM:.2f}) and every teacher gained on its cell (beyond 2 se)",
            "pass": not full and not flat,
            **({"left_out": left} if left else {}),
            "measured": "start " + ", ".join(f"{k} {v:.3f}" for k, v in start.items())
                        + "; teacher - start " + rp.paired_list(gain)
                        + (f"; no headroom: {full}" if full else "")
                        + (f"; no gain: {flat}" if flat else "")}


def claims(results: dict) -> list[dict]:
    """The recipe's claims, from a results.json dict alone (module doc).

    A cell the precondition leaves out (no headroom, or a teacher that did not gain) is left
    out of every per-cell claim below, which is judged on the other cells and says which were
    left out (``scope``); the competition claim (start against the other domain's specialist)
    does not read the teachers' gains and keeps every cell. When every cell is left out,
    nothing is judged."""
    t = results["table"]
    pre = precondition(results)
    out = [pre]
    left_out = pre.get("left_out", [])
    cells = [c for c in t["pass"] if c not in left_out]
    nothing = not cells     # then every claim prints its numbers, not judged
    cells = cells or list(t["pass"])
    keep = lambda d: {c: v for c, v in d.items() if c in cells}      # noqa: E731
    gain = {cell: v["teacher"] for cell, v in t["vs_start"].items()}
    out.append({"claim": f"every teacher beats the start on its cell by >= {GAIN} pass rate "
                         f"beyond {GAIN_K:g} se",
                "pass": all(rp.beats(g, GAIN, GAIN_K) for g in keep(gain).values()),
                "measured": rp.paired_list(gain)})
    comp = t["competition"]
    competition = {"claim": f"each specialist loses >= {LOSS} pass rate on the other domain "
                            f"beyond {LOSS_K:g} se (start - specialist, at {results['top']} "
                            f"effort): the domains compete",
                   "pass": bool(comp) and all(rp.beats(p, LOSS, LOSS_K) for p in comp.values()),
                   "measured": rp.paired_list(comp)}
    out.append(competition)
    for who in ("teacher", "student"):
        eff, judged = {}, []
        for k, v in t["effort"].items():
            if not k.startswith(who + " "):
                continue
            domain = k.split(" ", 1)[1]
            for gap, p in v.items():        # "max-high": both ends must be judged cells
                eff[f"{domain} {gap}"] = p
                if all(f"{domain}/{e}" in cells for e in gap.split("-")):
                    judged.append(p)
        out.append({"claim": f"effort binds in pass rate ({who}s): every gap down the ladder "
                             f"(max - high, high - low) >= {EFFORT_GAP}",
                    "pass": all(p["diff"] >= EFFORT_GAP for p in judged),
                    "measured": rp.paired_list(eff)})
    ret = t["retention"]
    finite = {k: v for k, v in keep(ret).items() if np.isfinite(v)}
    mean = float(np.mean(list(finite.values()))) if finite else float("nan")
    worst = min(finite, key=finite.get) if finite else None
    out.append({"claim": f"the student keeps the teachers' gains: (student - start) / (teacher "
                         f"- start) >= {RETENTION_MEAN} on average and >= {RETENTION_WORST} on "
                         f"every cell",
                "pass": len(finite) == len(keep(ret)) and mean >= RETENTION_MEAN
                        and finite[worst] >= RETENTION_WORST,
                "measured": f"mean {mean:.1%}"
                            + (f" over the {len(finite)} judged cells" if left_out else "")
                            + "; " + ", ".join(f"{k} {v:.1%}" for k, v in ret.items())})
    vm = t["student_vs_merge"]
    scales = sorted({s["merge_chosen"] for s in results["per_seed"]})
    out.append({"claim": f"the student beats the validation-tuned merge on every cell beyond "
                         f"{MERGE_K:g} se",
                "pass": all(rp.beats(p, 0.0, MERGE_K) for p in keep(vm).values()),
                "measured": rp.paired_list(vm) + f"; chosen on validation: {', '.join(scales)}"})
    if "student_vs_mixed" in t:
        out.append(mixed_claim(results, cells))
    if "student_vs_sampled" in t:
        out.append(sampled_claim(results, cells))
    if "curves" in results["per_seed"][0]:      # results from before 2026-12-07 lack curves
        out.append(compute_claim(results, cells))
    if nothing:
        for cl in out[1:]:
            cl["judged"] = False
    elif left_out:
        scope = (f"{len(cells)} of {len(t['pass'])} cells; {', '.join(left_out)} left "
                 f"out by the precondition")
        for cl in out[1:]:
            if cl is not competition:       # it reads every cell
                cl["scope"] = scope
    return out


def mixed_claim(results: dict, cells) -> dict:
    """The student against the mixed-data baseline, judged on ``cells``, with what each cost:
    the baseline's stages against the specialists' (their SFT and GRPO rungs) and the
    student's, FLOPs summed over seeds."""
    vm = results["table"]["student_vs_mixed"]
    flops = {}
    for s in results["per_seed"]:
        for name, cost in s["stages"].items():
            kind = ("mixed" if name in ("mixed_sft", MIXED) else
                    "specialists and student" if name.startswith(("sft_", "rl_", "plain_"))
                    or name == "student" else None)
            if kind:
                flops[kind] = flops.get(kind, 0.0) + float(cost.get("flops") or 0.0)
    mixed, ours = flops.get("mixed", 0.0), flops.get("specialists and student", 0.0)
    return {"claim": f"the student beats the mixed-data baseline (SFT then GRPO of one model "
                     f"on every domain's data, no specialists) on every cell beyond "
                     f"{MERGE_K:g} se",
            "pass": all(rp.beats(vm[c], 0.0, MERGE_K) for c in cells),
            "measured": rp.paired_list(vm) + f"; FLOPs: mixed {mixed:.2e}, specialists and "
                        f"student {ours:.2e} (ratio {rp.ratio(mixed, ours):.2f})"}


def _mean_flops(results: dict, stage: str) -> float:
    return float(np.mean([s["stages"][stage]["flops"] for s in results["per_seed"]]))


def sampled_claim(results: dict, cells) -> dict:
    """The student against the sampled-token student from the same point (module doc, 5):
    better on every cell of ``cells`` beyond 2 se, with no more compute (FLOPs within 10%)."""
    vs = results["table"]["student_vs_sampled"]
    ours, theirs = _mean_flops(results, "student"), _mean_flops(results, SAMPLED)
    return {"claim": f"the student beats the sampled-token student (same start, rollouts and "
                     f"optimizer steps; FLOPs at most 1.1x) on every cell beyond {MERGE_K:g} se",
            "pass": all(rp.beats(vs[c], 0.0, MERGE_K) for c in cells) and ours <= 1.1 * theirs,
            "measured": rp.paired_list(vs) + f"; FLOPs per seed: student {ours:.2e}, "
                        f"sampled-token {theirs:.2e} (ratio {rp.ratio(ours, theirs):.2f})"}


def speed_rows(results: dict) -> dict[str, dict]:
    """Per cell: when the student first held SPEED_SHARE of the teacher's gain (its in-run
    held-out pass rate, mean over seeds at the iterations every seed evaluated, against the
    report's pooled start and teacher), the FLOPs it had spent by then (its FLOPs per
    iteration x that iteration) and the FLOPs of the teacher's path from the start (module
    doc), means over seeds."""
    per_seed, t = results["per_seed"], results["table"]
    runs = [s["stages"]["student"] for s in per_seed]
    per_iter = float(np.mean([r["flops"] / r["iterations"] for r in runs]))
    out = {}
    for cell, p in t["pass"].items():
        target = p["start"] + SPEED_SHARE * (p["teacher"] - p["start"])
        steps, mean = rp.pooled_curve([s["curves"]["student"][cell] for s in per_seed])
        hit = next((x for x, y in zip(steps, mean) if y >= target), None)
        teacher = float(np.mean([sum(s["stages"][n]["flops"] for n in s["paths"][cell])
                                 for s in per_seed]))
        spent = None if hit is None else per_iter * hit
        out[cell] = {"target": target, "iteration": hit, "iterations": runs[0]["iterations"],
                     "best": max(mean) if mean else float("nan"),
                     "student_flops": spent, "teacher_flops": teacher,
                     "ratio": None if spent is None else spent / teacher}
    return out


def compute_claim(results: dict, cells) -> dict:
    """OPD's cheapness in compute (module doc): on every cell of ``cells`` the student holds
    SPEED_SHARE of the teacher's gain within 1 / SPEED_RATIO of the teacher's path FLOPs."""
    rows = speed_rows(results)

    def said(cell, r):
        if r["iteration"] is None:
            return (f"{cell} never in {r['iterations']} iterations (best {r['best']:.3f}, "
                    f"needs {r['target']:.3f})")
        return (f"{cell} at iteration {r['iteration']}: {r['student_flops']:.2e} / "
                f"{r['teacher_flops']:.2e} = {r['ratio']:.2f}")
    return {"claim": f"the student holds {SPEED_SHARE:.0%} of each teacher's gain having spent "
                     f"<= 1/{SPEED_RATIO:g} of the FLOPs of that teacher's path from the start "
                     f"(in-run held-out evaluations, mean over seeds)",
            "pass": all(rows[c]["ratio"] is not None and rows[c]["ratio"] <= 1 / SPEED_RATIO
                        for c in cells),
            "measured": "; ".join(said(cell, r) for cell, r in rows.items())}


# -- tables and plots ------------------------------------------------------------------------
def write_markdown(path: str, results: dict) -> None:
    """results.md from a results.json dict (so the committed table can be regenerated)."""
    t, seeds, ev = results["table"], results["seeds"], results["eval"]
    plain = any("plain" in v for v in t["pass"].values())
    mixed = "student_vs_mixed" in t
    sampled = "student_vs_sampled" in t
    header = ["cell", "start", "teacher", "teacher - start (se)", "student",
              "student - start (se)", "gain kept", "merge", "student - merge (se)",
              *(["plain teacher"] if plain else []),
              *(["sampled-token", "its gain kept", "student - sampled (se)"] if sampled
                else []),
              *(["mixed", "student - mixed (se)"] if mixed else []), "length T / S"]
    rows = []
    for cell, p in t["pass"].items():
        vs, vm = t["vs_start"][cell], t["student_vs_merge"][cell]
        rows.append([cell, f"{p['start']:.3f}", f"{p['teacher']:.3f}",
                     f"{vs['teacher']['diff']:+.3f} ({vs['teacher']['se']:.3f})",
                     f"{p['student']:.3f}",
                     f"{vs['student']['diff']:+.3f} ({vs['student']['se']:.3f})",
                     f"{t['retention'][cell]:.1%}", f"{p['merge']:.3f}",
                     f"{vm['diff']:+.3f} ({vm['se']:.3f})",
                     *([f"{p['plain']:.3f}"] if plain else []),
                     *([f"{p[SAMPLED]:.3f}", f"{t['sampled_retention'][cell]:.1%}",
                        f"{t['student_vs_sampled'][cell]['diff']:+.3f} "
                        f"({t['student_vs_sampled'][cell]['se']:.3f})"] if sampled else []),
                     *([f"{p[MIXED]:.3f}", f"{t['student_vs_mixed'][cell]['diff']:+.3f} "
                        f"({t['student_vs_mixed'][cell]['se']:.3f})"] if mixed else []),
                     f"{t['length'][cell]['teacher']:.0f} / {t['length'][cell]['student']:.0f}"])
    rew = [[cell, *[f"{r[m]:.3f}" for m in ("start", "teacher", "student", "merge")]]
           for cell, r in t["reward"].items()]
    costs = {name: [s["stages"][name] for s in results["per_seed"]]
             for name in results["per_seed"][0]["stages"]}
    n_problems = ev["n"] * len(seeds)
    cache = results["per_seed"][0].get("teacher_cache")
    cache_line = ([f"The student's teacher cache (seed {seeds[0]}): {cache['loads']} loads, "
                   f"{cache['evictions']} evictions, {cache['hits']} hits for "
                   f"{len(t['pass'])} teachers.", ""] if cache else [])
    speed = (["## Compute to 90% of each teacher's gain", "", speed_table(results), ""]
             if "curves" in results["per_seed"][0] else [])
    md = [f"# {results['recipe']} results ({len(seeds)} seed(s): {list(seeds)})", "",
          rp.provenance_line(results["provenance"]), "",
          f"Pass rate (verifier correctness) on held-out problems (eval split, greedy, "
          f"difficulty {ev['difficulty']}), {ev['n']} per cell and seed, each seed its own "
          f"problems: {n_problems} per cell. Differences are paired per problem; se counts "
          f"problems. Gain kept = (student - start) / (teacher - start). The merge is task "
          f"arithmetic of the cell teachers at the scale with the best validation pass rate "
          f"(train-split problems).", "", rp.markdown_table(header, rows), "",
          *cache_line, "## Claims", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", *speed, "## Reward (the training signal, with the length penalty; no claim reads it)",
           "", rp.markdown_table(["cell", "start", "teacher", "student", "merge"], rew), "",
           "## Compute per stage (mean over seeds)", "", rp.cost_table(costs), "",
           "FLOPs: 2N per token through a forward pass, 2N_T per teacher-scored token, 6N "
           "per trained token (`opd_jax.trainers.compute`).", "",
           "![pass rate](curves.png)", "", "![gain kept](retention.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))


def speed_table(results: dict) -> str:
    """`speed_rows` as a markdown table."""
    rows = [[cell, f"{r['target']:.3f}", f"{r['best']:.3f}",
             "never" if r["iteration"] is None else f"{r['iteration']} of {r['iterations']}",
             "-" if r["student_flops"] is None else f"{r['student_flops']:.2e}",
             f"{r['teacher_flops']:.2e}", "-" if r["ratio"] is None else f"{r['ratio']:.2f}"]
            for cell, r in speed_rows(results).items()]
    return "\n".join([
        rp.markdown_table(["cell", "90% of the gain", "best in-run (mean over seeds)",
                           "first iteration there", "student FLOPs by then",
                           "teacher's path FLOPs", "ratio (claim: <= 0.2)"], rows), "",
        "The student's in-run held-out evaluations (its own problem draw, "
        "`student.eval.n` per cell and seed) against the pooled start and teacher above; the "
        "teacher's path is its specialist SFT and every GRPO rung it descends from."])


def plot(c: ml_collections.ConfigDict, workdir: str, results: dict) -> None:
    """curves.png (the first seed's student in-run held-out pass rate per cell against its
    teacher, the merge and the start) and retention.png (gain kept by student and merge)."""
    t, seed, n = results["table"], results["seeds"][0], results["eval"]["n"]
    names = list(t["pass"])
    sw = os.path.join(workdir, f"seed{seed}")
    curves = {}
    for cell in names:
        xs, ys = rp.curve(sw, "student", f"heldout/{cell}/pass_rate")
        p = t["pass"][cell]
        sampled = ([{"x": sx, "y": sy, "label": "sampled-token student"}
                    for sx, sy in [rp.curve(sw, SAMPLED, f"heldout/{cell}/pass_rate")]]
                   if SAMPLED in p else [])
        curves[cell] = [{"x": xs, "y": ys,
                         "label": f"student ({c.student.objective.name}), in-run eval "
                                  f"n={c.student.eval.n}"}, *sampled,
                        {"y": p["teacher"], "label": f"teacher (n={n} x seeds)", "color": "k"},
                        {"y": p["merge"], "label": "merge (validation-tuned)", "color": "r"},
                        {"y": p["start"], "label": "start", "color": "gray"},
                        *([{"y": p[MIXED], "label": "mixed-data baseline", "color": "g"}]
                          if MIXED in p else [])]
    rp.plot_curves(os.path.join(workdir, "curves.png"), curves,
                   title=f"{c.recipe}: student held-out pass rate per cell (seed {seed})",
                   ylabel="held-out pass rate")
    rp.plot_bars(os.path.join(workdir, "retention.png"), names, {
        "student": [t["retention"][k] for k in names],
        "merge": [t["merge_retention"][k] for k in names],
        **({"sampled-token student": [t["sampled_retention"][k] for k in names]}
           if "sampled_retention" in t else {})},
        title=f"{c.recipe}: share of the teacher's gain over the start kept",
        ylabel="(model - start) / (teacher - start)", hline=1.0)

