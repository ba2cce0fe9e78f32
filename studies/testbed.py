"""Does the testbed have the seed's phenomena? Effort that binds, domains that compete.

From the shipped base (``builtin:base``), for each seed and each testbed domain, a
specialist: SFT on that domain's train-split demos (all three efforts), then GRPO on it.
Every model (the base and each specialist) is evaluated greedily on the eval split of
*every* domain at that domain's evaluation difficulty, under every effort, on the same
problems (the seed picks the problem draw). Two measurements come out:

* **effort**: per model and domain, pass rate under max > high > low, by >= 0.10 each;
* **competition**: a specialist's pass rate at max effort on the *other* domains, against
  the base's (a fall of >= 0.10 is what mixed RL and weight merging then have to fight).

Pass rate is verifier correctness: the length penalty of the reward is no part of it.

    python -m studies.testbed --workdir runs/testbed     # 3 seeds; re-run resumes
                                                         # (finished evals are cached)
    python -m studies.testbed --workdir runs/tb --init experiments/dose/bases/b32 \
        --domains general,coding --sft-steps 60 --sft-lr 1e-3 --rl-steps 0 --seeds 0

Results: ``<workdir>/results.json`` (every row, with seeds, commit, command, wall time) and
``results.md`` (tables and PASS/FAIL computed from it); the committed copy lives in
``experiments/testbed/results/``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from opd_jax.episodes import SamplingConfig
from opd_jax.models import ModelRef, synthetic_tokenizer
# one table of families and efforts, the domains' evaluation difficulties and the sampling:
# the library's testbed (docs/testbed.md), the one the base was pretrained and carded on
from opd_jax.recipes import EFFORTS, EVAL_DIFFICULTY, SAMPLING, TESTBED, trainer_config
from opd_jax.recipes.pipeline import Stage, run_stages, stage_dir
from opd_jax.recipes.report import code_commit
from opd_jax.trainers.evaluate import evaluate_model

SEEDS = (0, 1, 2)
EVAL_N = 128          # issue 31: >= 128 held-out problems per cell
MARGIN = 0.10


def stages(seed: int, *, init: str = "builtin:base", sft_steps: int = 150,
           rl_steps: int = 20, sft_lr: float = 5e-4, domains=tuple(TESTBED)) -> list:
    """Per domain: ``sft_<domain>``, then ``specialist_<domain>`` (GRPO; with rl_steps=0 the
    SFT stage is the specialist)."""
    out = []
    for domain in domains:
        fam = TESTBED[domain]
        d = EVAL_DIFFICULTY[domain]
        sft = trainer_config(
            "sft.py:tasks", f"--config.model.init_from={init}", f"--config.seed={seed}",
            f"--config.data.seed={seed}", f"--config.data.tasks.families={{'{domain}': '{fam}'}}",
            f"--config.data.tasks.difficulty={d}", "--config.data.tasks.seed=" + str(seed),
            "--config.data.seq_len=320", "--config.data.packing=True",
            "--config.data.batch_size=24", f"--config.train.steps={sft_steps}",
            f"--config.train.ckpt_every={sft_steps}", f"--config.optim.lr={sft_lr}",
            "--config.optim.warmup_steps=10")
        rl = trainer_config(
            "grpo.py:tiny", f"--config.seed={seed}", f"--config.tasks.seed={seed}",
            f"--config.tasks.families={{'{domain}': '{fam}'}}", f"--config.tasks.efforts={EFFORTS}",
            f"--config.tasks.difficulty={d}", f"--config.train.steps={rl_steps}",
            f"--config.train.ckpt_every={rl_steps}", "--config.rollout.prompts_per_step=16",
            "--config.rollout.group_size=4", "--config.optim.lr=1e-4",
            f"--config.rollout.sampling.max_new_tokens={SAMPLING['max_new_tokens']}",
            f"--config.rollout.sampling.max_turns={SAMPLING['max_turns']}",
            "--config.eval.every=0", "--config.eval.n=16",
            f"--config.eval.sampling.max_new_tokens={SAMPLING['max_new_tokens']}",
            f"--config.eval.sampling.max_turns={SAMPLING['max_turns']}")
        out.append(Stage(f"sft_{domain}", "sft", sft))
        if rl_steps:
            out.append(Stage(f"specialist_{domain}", "grpo", rl, init_from=f"sft_{domain}"))
    return out


def specialist_stage(domain: str, rl_steps: int) -> str:
    return f"specialist_{domain}" if rl_steps else f"sft_{domain}"


def evaluate_domain(path: str, domain: str, seed: int, n: int = EVAL_N) -> list[dict]:
    """Rows for one domain x every effort at the domain's evaluation difficulty (eval split)."""
    return evaluate_model(ModelRef(path).load(), synthetic_tokenizer(),
                          {domain: TESTBED[domain]}, EFFORTS, n=n, seed=seed,
                          difficulty=EVAL_DIFFICULTY[domain],
                          sampling=SamplingConfig(**SAMPLING))


def _cached_eval(wd: str, name: str, path: str, seed: int, n: int) -> list[dict]:
    """Every domain's rows for one model, each cached under a name that carries the family,
    difficulty and sample count, so a changed setting never reuses stale rows."""
    rows = []
    for domain, fam in TESTBED.items():
        out_json = os.path.join(wd, f"eval_{name}_{fam}_d{EVAL_DIFFICULTY[domain]}_n{n}.json")
        if os.path.exists(out_json):
            with open(out_json, encoding="utf-8") as f:
                rows += json.load(f)
            continue
        got = evaluate_domain(path, domain, seed, n)
        tmp = out_json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(got, f, indent=1)
        os.replace(tmp, out_json)
        rows += got
    return rows


def run(workdir: str, seeds=SEEDS, *, init: str = "builtin:base", n: int = EVAL_N,
        domains=tuple(TESTBED), rl_steps: int = 20, **stage_kw) -> dict:
    t0 = time.time()
    records = []
    for seed in seeds:
        wd = os.path.join(workdir, f"seed{seed}")
        done = run_stages(stages(seed, init=init, domains=domains, rl_steps=rl_steps,
                                 **stage_kw), wd)
        models = {"base": init, **{f"specialist_{d}": stage_dir(wd, specialist_stage(d, rl_steps))
                                   for d in domains}}
        for name, path in models.items():
            for r in _cached_eval(wd, name, path, seed, n):
                records.append({**r, "model": name, "seed": seed})
        records.append({"model": "_stages", "seed": seed, "done": done})
    return {"rows": records, "wall_s": time.time() - t0}


def _std(v: np.ndarray) -> float:
    return float(v.std(ddof=1)) if len(v) > 1 else 0.0


def summarize(rows: list[dict], metric: str = "pass_rate") -> dict:
    """Mean ± std over seeds of `metric` (pass rate; "reward" for the penalised reward) per
    (model, domain, effort), and the two claims."""
    rows = [r for r in rows if r["model"] != "_stages"]
    seeds = sorted({r["seed"] for r in rows})
    models = list(dict.fromkeys(r["model"] for r in rows))
    cell = {(r["model"], r["domain"], r["effort"], r["seed"]): r[metric] for r in rows}

    def per_seed(m, d, e):
        return np.array([cell[(m, d, e, s)] for s in seeds if (m, d, e, s) in cell])

    table = {}
    for m in models:
        for d in TESTBED:
            for e in EFFORTS:
                v = per_seed(m, d, e)
                table[f"{m}|{d}|{e}"] = (float(v.mean()), _std(v))
    effort = []   # the base on every domain, a specialist on its own (elsewhere it forgot)
    for m in models:
        for d in TESTBED:
            if m != "base" and m != f"specialist_{d}":
                continue
            lo, hi, mx = (per_seed(m, d, e) for e in EFFORTS)
            gaps = (hi - lo, mx - hi)
            effort.append({"model": m, "domain": d,
                           "high_minus_low": float(gaps[0].mean()),
                           "high_minus_low_std": _std(gaps[0]),
                           "max_minus_high": float(gaps[1].mean()),
                           "max_minus_high_std": _std(gaps[1]),
                           "pass": bool(min(float(g.mean()) for g in gaps) >= MARGIN)})
    compete = []
    for d_spec in TESTBED:
        m = f"specialist_{d_spec}"
        if m not in models:
            continue
        for d in TESTBED:
            if d == d_spec:
                continue
            base, spec = per_seed("base", d, EFFORTS[-1]), per_seed(m, d, EFFORTS[-1])
            drop = base - spec
            compete.append({"specialist": d_spec, "domain": d, "base": float(base.mean()),
                            "specialist_reward": float(spec.mean()),
                            "drop_mean": float(drop.mean()),
                            "drop_std": _std(drop),
                            "pass": bool(drop.mean() >= MARGIN)})
    return {"seeds": seeds, "models": models, "table": table, "effort": effort,
            "compete": compete, "metric": metric}


def report_md(summary: dict, meta: dict) -> str:
    s = summary
    lines = ["# Testbed measurements", "",
             f"Seeds {s['seeds']}; commit {meta['commit']}; command `{meta['command']}`; "
             f"wall time {meta['wall_s'] / 60:.0f} min; {meta.get('n', EVAL_N)} eval-split "
             f"problems per cell "
             f"and seed, greedy; evaluation difficulty {meta['eval_difficulty']}.", "",
             f"## {s['metric']} per model, domain and effort (mean ± std over seeds)", "",
             "| model | domain | " + " | ".join(EFFORTS) + " |", "|---|---|" + "---:|" * 3]
    for m in s["models"]:
        for d in TESTBED:
            lines.append(f"| {m} | {d} | " + " | ".join(
                "{:.3f} ± {:.3f}".format(*s["table"][f"{m}|{d}|{e}"]) for e in EFFORTS) + " |")
    lines += ["", f"## Effort binds: max > high > low by >= {MARGIN} each (mean ± std over "
              "seeds; the base on every domain, a specialist on its own)", "",
              "| model | domain | high - low | max - high | claim |", "|---|---|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['domain']} | {r['high_minus_low']:+.3f} ± "
              f"{r['high_minus_low_std']:.3f} | {r['max_minus_high']:+.3f} ± "
              f"{r['max_minus_high_std']:.3f} | {'PASS' if r['pass'] else 'FAIL'} |"
              for r in s["effort"]]
    lines += ["", f"## Domains compete: a specialist loses >= {MARGIN} on the other domains "
              f"(at {EFFORTS[-1]} effort)", "",
              "| specialist | domain | base | specialist | drop (mean ± std) | claim |",
              "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['specialist']} | {r['domain']} | {r['base']:.3f} | "
              f"{r['specialist_reward']:.3f} | {r['drop_mean']:+.3f} ± {r['drop_std']:.3f} | "
              f"{'PASS' if r['pass'] else 'FAIL'} |" for r in s["compete"]]
    return "\n".join(lines) + "\n"


def write_results(workdir: str, result: dict, command: str, n: int = EVAL_N) -> str:
    meta = {"commit": code_commit(), "command": command, "wall_s": result["wall_s"],
            "eval_difficulty": EVAL_DIFFICULTY, "n": n}
    summary = summarize(result["rows"])
    with open(os.path.join(workdir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({**meta, "rows": result["rows"], "summary": summary}, f, indent=1,
                  default=str)
    md = report_md(summary, meta)
    with open(os.path.join(workdir, "results.md"), "w", encoding="utf-8") as f:
        f.write(md)
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/testbed")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--init", default="builtin:base")
    p.add_argument("--eval-n", type=int, default=EVAL_N)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--rl-steps", type=int, default=20, help="0: the SFT is the specialist")
    p.add_argument("--sft-lr", type=float, default=5e-4)
    p.add_argument("--domains", default=",".join(TESTBED))
    args = p.parse_args(argv)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    result = run(args.workdir, seeds, init=args.init, n=args.eval_n, sft_steps=args.sft_steps,
                 rl_steps=args.rl_steps, sft_lr=args.sft_lr,
                 domains=tuple(args.domains.split(",")))
    print(write_results(args.workdir, result,
                        "python -m studies.testbed " + " ".join(argv or sys.argv[1:]),
                        n=args.eval_n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
