"""Issue 31's dose table: how many pretraining demos at a teacher cell's evaluation difficulty
leave the base headroom there (pass rate 0.2-0.6 at max effort) while it still learns the
format, the effort tokens and the tools from the easier difficulties.

    python -m studies.base_model --workdir runs/base_dose60 --stage train \
        --config.data.corpus.dose="{'chain': {'3': 60, '4': 0, '5': 0}, ...}"
    python -m studies.dose_table --run dose60=runs/base_dose60 --reference builtin:base \
        --out experiments/dose

Each base (an SFT workdir of `studies.base_model`, whose config.json records its dose, or
the shipped base as the full-density reference) is evaluated on the eval split, greedy with
the think budget enforced (the card's sampling), on the candidate teacher families at the
given difficulties and every effort: pass rate (verifier correctness, no length penalty) and
reward, with standard errors that count problems (each seed draws other problems).
Writes ``results.json`` and ``results.md`` (command, commit, wall time) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from opd_jax.recipes.report import code_commit
from studies.base_model import evaluate_card

# The candidate teacher families (domain -> family): the testbed's three and arithmetic,
# the general family the issue measured as competing with code_trace.
CANDIDATES = (("general", "arithmetic"), ("general", "chain"), ("agent", "tool_chain"),
              ("coding", "code_trace"))


def run_dose(workdir: str) -> dict:
    """The dose a base's run was trained with (its config.json), {} for none."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("data", {}).get("corpus", {}).get("dose", {}) or {}


def table_rows(rows: list[dict]) -> list[dict]:
    """Pooled over seeds per (base, family, difficulty, effort): pass rate and reward with
    the standard error over the N problems (n per seed x seeds, all distinct)."""
    keys = list(dict.fromkeys((r["base"], r["family"], r["difficulty"], r["effort"])
                              for r in rows))
    out = []
    for key in keys:
        rs = [r for r in rows if (r["base"], r["family"], r["difficulty"], r["effort"]) == key]
        n = sum(r["n"] for r in rs)
        p = sum(r["pass_rate"] * r["n"] for r in rs) / n
        out.append(dict(zip(("base", "family", "difficulty", "effort"), key), n=n,
                        pass_rate=p, pass_se=math.sqrt(max(p * (1 - p), 0.0) / n),
                        reward=sum(r["reward"] * r["n"] for r in rs) / n))
    return out


def markdown(result: dict) -> str:
    lines = ["# Dose table (issue 31)\n", f"Command: `{result['command']}`; commit "
             f"{result['commit']}; {result['wall_s'] / 60:.1f} minutes; eval split, greedy, "
             f"{result['n']} problems per cell and seed, seeds {result['seeds']}.\n"]
    for name, dose in result["doses"].items():
        lines.append(f"- **{name}**: dose {json.dumps(dose) if dose else 'none (full density)'}")
    lines += ["", "| base | family | difficulty | low pass | high pass | max pass | max reward |",
              "|---|---|---:|---:|---:|---:|---:|"]
    by = {(r["base"], r["family"], r["difficulty"], r["effort"]): r for r in result["table"]}
    for base, fam, d in dict.fromkeys((r["base"], r["family"], r["difficulty"])
                                      for r in result["table"]):
        cells = [by.get((base, fam, d, e)) for e in ("low", "high", "max")]
        lines.append(f"| {base} | {fam} | {d} | " + " | ".join(
            f"{c['pass_rate']:.3f} ± {c['pass_se']:.3f}" for c in cells) +
            f" | {cells[-1]['reward']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", default=[], metavar="NAME=WORKDIR",
                   help="a dosed base: the SFT workdir of studies.base_model")
    p.add_argument("--reference", default="builtin:base", help="the full-density base")
    p.add_argument("--difficulties", default="2,3")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="experiments/dose")
    p.add_argument("--reuse", action="store_true",
                   help="keep the rows of bases already in --out/results.json (same n, seeds "
                        "and difficulties): the table grows one dose at a time")
    args = p.parse_args(argv)
    bases = {"reference": args.reference}
    doses = {"reference": {}}
    for item in args.run:
        name, _, workdir = item.partition("=")
        if not name or not workdir:
            raise SystemExit(f"--run {item!r}: expected NAME=WORKDIR")
        bases[name], doses[name] = workdir, run_dose(workdir)
    diffs = tuple(int(d) for d in args.difficulties.split(","))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    t0, rows, done = time.time(), [], set()
    old_file = os.path.join(args.out, "results.json")
    if args.reuse and os.path.isfile(old_file):
        with open(old_file, encoding="utf-8") as f:
            old = json.load(f)
        same = (old["n"], old["seeds"], old.get("difficulties")) == (args.n, list(seeds),
                                                                     list(diffs))
        if not same:
            raise SystemExit(f"--reuse: {old_file} was measured with n={old['n']}, seeds "
                             f"{old['seeds']}, difficulties {old.get('difficulties')}; "
                             f"expected n={args.n}, seeds {list(seeds)}, {list(diffs)}")
        for name in old["bases"]:
            if name not in bases or bases[name] == old["bases"][name]:
                rows += [r for r in old["rows"] if r["base"] == name]
                bases.setdefault(name, old["bases"][name])
                doses.setdefault(name, old["doses"][name])
                done.add(name)
    for name, path in bases.items():
        if name in done:
            continue
        for domain, fam in CANDIDATES:
            rows += [{**r, "base": name} for r in evaluate_card(
                path, n=args.n, seeds=seeds, difficulties=diffs, families={domain: fam})]
    result = {"command": " ".join(["python -m studies.dose_table", *sys.argv[1:]]),
              "commit": code_commit(), "wall_s": time.time() - t0, "n": args.n,
              "seeds": list(seeds), "difficulties": list(diffs), "doses": doses, "bases": bases, "rows": rows,
              "table": table_rows(rows)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
