"""The README's rollout speed table, generated from the committed results files.

    python benchmarks/speed_table.py            # rewrite the table in README.md
    python benchmarks/speed_table.py --check    # exit 1 if README.md's table is not this

Reads benchmarks/results/rollout_cpu.txt (`benchmarks/rollout.py`: the 19M Qwen3-shaped
model, B=16) and benchmarks/results/rollout_real_cpu.txt (`benchmarks/rollout_real.py`:
SmolLM2-135M at B = 1, 16, 64), each headed by its date, commit, command and machine load,
and writes one row per (model, batch, mode) between the README's
``<!-- speed-table:begin -->`` and ``<!-- speed-table:end -->`` markers. Nothing in the
table is typed by hand: a number that is not in a results file is not in the table.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BEGIN, END = "<!-- speed-table:begin -->", "<!-- speed-table:end -->"
NUM = r"([0-9.]+)"


def _find(pattern: str, text: str, what: str, path: str) -> re.Match:
    m = re.search(pattern, text, re.M)
    if m is None:
        raise ValueError(f"{path}: no {what} (pattern {pattern!r}); re-run the benchmark "
                         f"that writes it")
    return m


def _head(text: str, path: str) -> dict:
    return {"commit": _find(r"^commit (\w+)", text, "commit line", path).group(1),
            "date": text.splitlines()[0].strip()}


def toy_rows(path: str) -> list[dict]:
    """Rows of benchmarks/rollout.py's results (19M model, one batch, two modes)."""
    text = open(path, encoding="utf-8").read()
    head = _head(text, path)
    setting = _find(r"batch (\d+), prompt (\d+), (\d+) new tokens", text, "setting", path)
    load = _find(r"load average " + NUM + " before, " + NUM + " after", text, "load", path)
    rows = []
    for block in re.split(r"^--- ", text, flags=re.M)[1:]:
        mode = block.splitlines()[0].strip()
        ours = _find(r"opd_jax rollout :\s+" + NUM + r" tok/s", block, "our rate", path)
        frac = _find(r"= (\d+)% of the measured bandwidth", block, "bandwidth share", path)
        hf = _find(r"ratio ours / transformers: " + NUM + "x", block, "transformers ratio", path)
        tunix = re.search(r"ours / tunix: " + NUM + "x", block)
        # the median over fresh processes when the file has it (a process compiles once)
        comp = _find(r"compile \(first call minus a warm call\): " + NUM + r" s(?: in this "
                     r"process)?(?:; \d+ fresh processes: median " + NUM + r" s \([^)]*\))?; "
                     r"compiles on a call with new [^:]+: (\d+)", block, "compile line", path)
        rows.append(dict(head, model="19M Qwen3-shaped (4 layers, vocab 32k)",
                         batch=int(setting.group(1)), mode=mode, ours=float(ours.group(1)),
                         hf=float(hf.group(1)),
                         tunix=float(tunix.group(1)) if tunix else None,
                         bound=f"weights read at {frac.group(1)}% of bandwidth",
                         compile=float(comp.group(2) or comp.group(1)),
                         recompiles=int(comp.group(3)),
                         load=f"{load.group(1)} / {load.group(2)}"))
    return rows


def real_rows(path: str) -> list[dict]:
    """Rows of benchmarks/rollout_real.py's results (SmolLM2-135M, each batch and mode)."""
    text = open(path, encoding="utf-8").read()
    head = _head(text, path)
    before = _find(r"load average before " + NUM, text, "load before", path).group(1)
    after = _find(r"load average after " + NUM, text, "load after", path).group(1)
    rows = []
    for block in re.split(r"^--- ", text, flags=re.M)[1:]:
        m = re.match(r"batch (\d+), (\w+)", block)
        ours = _find(r"opd_jax\s+:\s+" + NUM + r" tok/s \([^)]*\); (\d+)% of the weight-read "
                     r"bound, (\d+)% of the FLOP bound", block, "our rate", path)
        hf = _find(r"ratio ours / transformers " + NUM + "x", block, "transformers ratio",
                   path)
        # signed: a mode whose program the previous mode compiled can time below zero
        comp = _find(r"compile (-?[0-9.]+) s; compiles on a call with new [^:]+: (\d+)",
                     block, "compile line", path)
        B = int(m.group(1))
        bound = (f"{ours.group(2)}% of weight-read bound" if B == 1
                 else f"{ours.group(3)}% of FLOP bound")
        rows.append(dict(head, model="SmolLM2-135M (30 layers, vocab 49k)", batch=B,
                         mode=m.group(2), ours=float(ours.group(1)), hf=float(hf.group(1)),
                         tunix=None, bound=bound, compile=float(comp.group(1)),
                         recompiles=int(comp.group(2)), load=f"{before} / {after}"))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | batch | mode | ours tok/s | x transformers | x Tunix | vs its bound "
           "| compile s | recompiles on new knobs | load before / after | commit |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tunix = "-" if r["tunix"] is None else f"{r['tunix']:.2f}x"
        out.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['ours']:.1f} | "
                   f"{r['hf']:.2f}x | {tunix} | {r['bound']} | {r['compile']:.1f} | "
                   f"{r['recompiles']} | {r['load']} | {r['commit']} |")
    return "\n".join(out)


def render() -> str:
    rows = (toy_rows(os.path.join(RESULTS, "rollout_cpu.txt"))
            + real_rows(os.path.join(RESULTS, "rollout_real_cpu.txt")))
    return (f"{BEGIN}\n<!-- generated by benchmarks/speed_table.py from benchmarks/results/"
            f"rollout_cpu.txt and rollout_real_cpu.txt; do not edit -->\n{table(rows)}\n{END}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when README.md's table differs from the results files'")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = ap.parse_args(argv)
    text = open(args.readme, encoding="utf-8").read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{args.readme}: no {BEGIN} ... {END} markers to put the table in")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render() + text[stop:]
    if args.check:
        if new != text:
            print(f"{args.readme}: the speed table is not the one the results files give; "
                  f"run python benchmarks/speed_table.py", file=sys.stderr)
            return 1
        return 0
    with open(args.readme, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
