"""Cost curves: rollout tokens/s against batch size and length; fused-KL time and memory against N and V.

    PYTHONPATH=. python benchmarks/cost_curves.py                  # both parts: ~35-45 min on 2 cores
    PYTHONPATH=. python benchmarks/cost_curves.py --parts rollout --batches 1 4 16 64 --no-baseline
    PYTHONPATH=. python benchmarks/cost_curves.py --parts kl --kl-n 512 2048 8192 --kl-v 32768 262144
    PYTHONPATH=. python benchmarks/cost_curves.py --quick --out-dir /tmp/cc   # tiny smoke run, ~20 s

Rollout ("rollout"): new tokens per second of our jit sampler (`opd_jax.rollout.generate`)
for every batch size x generated length (--batches 1..64, --lengths 32..512), on the
benchmark model of benchmarks/rollout.py (4 layers, hidden 256, vocab 32k, a random HF
checkpoint made there), prompts of 16 tokens, temperature 1, every row running to its
length: best of --reps calls after a first call (compiles; its time is reported).
transformers' generate on the same weights is the baseline, in the same run, for the
points with batch x length <= --baseline-max-tokens (slow on a CPU; --no-baseline skips
it); the ratio is ours / transformers in tokens/s.

Fused KL ("kl"): value-and-grad of the mean fused reverse KL, "xla" (ours) against
"reference" (full logits) in the same run, fp32, D = E = --kl-d: over N (--kl-n, at
V = --kl-v-at) and over V (--kl-v, at N = --kl-n-at). Temporary memory comes from the
compiled executable's memory analysis (benchmarks/fused_kl.py's helpers), so it is
reported for every point; the reference is timed only where its temporaries fit under
--max-ref-gib (the rest would swap or be killed on a small machine). Timed calls alternate
between implementations; median of --reps.

Writes to --out-dir (benchmarks/results): cost_curves_cpu.md (the tables, with command,
commit, date, load average before and after), cost_curves_rollout_cpu.png and
cost_curves_kl_cpu.png. Machine state: idle cores (load average printed; other jobs slow
every point), about 6 GB of free memory with the defaults (--max-ref-gib 4).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import tempfile
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUICK = dict(batches=[1, 2], lengths=[8], vocab=512, layers=1, hidden=64, kl_n=[32, 64], kl_v=[1024, 2048], kl_n_at=32,
             kl_v_at=1024, kl_d=16, chunk_v=512, reps=1, baseline_reps=1)


def _sibling(name: str):
    """benchmarks/<name>.py (rollout, fused_kl, opd_iteration), whose helpers this script reuses."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return importlib.import_module(name)


def rollout_points(args, log) -> list[dict]:
    """Our sampler (and transformers where cheap) at every batch x length."""
    from opd_jax.models import load_pretrained
    from opd_jax.rollout import generate
    rollout = _sibling("rollout")
    rows = []
    with tempfile.TemporaryDirectory() as path:
        hf = rollout.hf_checkpoint(path, args.vocab, layers=args.layers, hidden=args.hidden)  # ours loads its files
        hf = None if args.no_baseline else hf
        model = load_pretrained(path)
        rng = np.random.default_rng(0)
        for b in args.batches:
            prompts = rng.integers(1, args.vocab, (b, args.prompt)).tolist()
            for new in args.lengths:
                def run(seed):
                    res = generate(model, prompts, max_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0,
                                   seed=seed)
                    assert all(len(r) == new for r in res.tokens), [len(r) for r in res.tokens]
                t = time.perf_counter()
                run(0)
                first = time.perf_counter() - t
                seeds = iter(range(1, args.reps + 1))
                ours = rollout.time_best(lambda: run(next(seeds)), args.reps)
                row = {"batch": b, "length": new, "ours": b * new / ours, "first_s": first, "hf": None}
                if hf is not None and b * new <= args.baseline_max_tokens:
                    row["hf"] = b * new / rollout.bench_hf(hf, prompts, new, args.baseline_reps)
                rows.append(row)
                log(f"rollout B={b:>3} L={new:>4}: ours {row['ours']:8.1f} tok/s (first call {first:.1f} s)"
                    + ("" if row["hf"] is None else f", transformers {row['hf']:8.1f} tok/s"))
    return rows


def kl_points(args, log) -> list[dict]:
    """(sweep, N, V, impl, temp bytes, median s or None) for the N sweep and the V sweep."""
    fused_kl = _sibling("fused_kl")
    rows, done = [], {}
    points = [("N", n, args.kl_v_at) for n in args.kl_n] + [("V", args.kl_n_at, v) for v in args.kl_v]
    for sweep, n, v in points:
        if (n, v) in done:      # a point of both sweeps is measured once
            rows += [dict(r, sweep=sweep) for r in done[(n, v)]]
            continue
        inputs = fused_kl.make_inputs(n, args.kl_d, v)
        fns = {impl: fused_kl.make_loss("reverse_kl", impl, args.chunk_v) for impl in ("reference", "xla")}
        compiled, temps = fused_kl.compile_all(fns, inputs)
        timed = {k: c for k, c in compiled.items() if k == "xla" or temps[k] <= args.max_ref_gib * 2**30}
        times = fused_kl.time_round_robin(timed, inputs, args.reps)
        done[(n, v)] = [{"sweep": sweep, "n": n, "v": v, "impl": impl, "temp": temps[impl], "s": times.get(impl)}
                        for impl in ("reference", "xla")]
        rows += done[(n, v)]
        ref = f"{times['reference']:.2f} s" if "reference" in times else "not timed (temp over --max-ref-gib)"
        log(f"kl {sweep}-sweep N={n:>5} V={v:>6}: xla {temps['xla'] / 2**20:9.1f} MiB {times['xla']:.2f} s; "
            f"reference {temps['reference'] / 2**20:9.1f} MiB {ref}")
        del compiled, timed, inputs
    return rows


def rollout_table(rows) -> list[str]:
    lines = ["| batch | length | ours tok/s | ours first call s | transformers tok/s | ours / transformers |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        hf = "-" if r["hf"] is None else f"{r['hf']:.1f}"
        ratio = "-" if r["hf"] is None else f"{r['ours'] / r['hf']:.2f}x"
        lines.append(f"| {r['batch']} | {r['length']} | {r['ours']:.1f} | {r['first_s']:.1f} | {hf} | {ratio} |")
    return lines


def kl_table(rows) -> list[str]:
    lines = ["| sweep | N | V | reference temp MiB | xla temp MiB | memory (ref / xla) | reference s | xla s | "
             "time (xla / ref) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["sweep"], r["n"], r["v"], r["impl"]): r for r in rows}
    for sweep, n, v, impl in by:
        if impl != "xla":
            continue
        x, ref = by[(sweep, n, v, "xla")], by[(sweep, n, v, "reference")]
        t_ref = "-" if ref["s"] is None else f"{ref['s']:.2f}"
        ratio = "-" if ref["s"] is None else f"{x['s'] / ref['s']:.2f}x"
        lines.append(f"| {sweep} | {n} | {v} | {ref['temp'] / 2**20:.1f} | {x['temp'] / 2**20:.1f} | "
                     f"{ref['temp'] / max(x['temp'], 1):.1f}x | {t_ref} | {x['s']:.2f} | {ratio} |")
    return lines


def plot_rollout(path, rows):
    from opd_jax.plotting import _plt
    plt = _plt(agg=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (x_key, line_key) in zip(axes, (("batch", "length"), ("length", "batch"))):
        for i, value in enumerate(sorted({r[line_key] for r in rows})):
            pts = sorted((r[x_key], r["ours"], r["hf"]) for r in rows if r[line_key] == value)
            color = f"C{i % 10}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=f"{line_key} {value}")
            hf = [(p[0], p[2]) for p in pts if p[2] is not None]
            if hf:
                ax.plot(*zip(*hf), ls="--", marker="x", color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel("new tokens / s")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, title="solid: ours, dashed: transformers", title_fontsize=7)
    fig.suptitle("rollout throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl(path, rows, args):
    from opd_jax.plotting import _plt
    plt = _plt(agg=True)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), squeeze=False)
    for col, (sweep, key, fixed) in enumerate((("N", "n", f"V={args.kl_v_at}"), ("V", "v", f"N={args.kl_n_at}"))):
        for impl, style in (("reference", "--"), ("xla", "-")):
            pts = sorted((r[key], r["temp"], r["s"]) for r in rows if r["sweep"] == sweep and r["impl"] == impl)
            if not pts:
                continue
            axes[0][col].plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], style, marker="o", label=impl)
            timed = [(p[0], p[2]) for p in pts if p[2] is not None]
            if timed:
                axes[1][col].plot(*zip(*timed), style, marker="o", label=impl)
        for row, ylabel in ((0, "temporary memory (MiB)"), (1, "value + grad (s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(f"{sweep} ({fixed}, D={args.kl_d})")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle("fused reverse KL: ours (xla) vs reference")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["rollout", "kl"], choices=["rollout", "kl"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    ap.add_argument("--baseline-max-tokens", type=int, default=1024,
                    help="transformers only where batch x length <= this")
    ap.add_argument("--baseline-reps", type=int, default=1)
    ap.add_argument("--kl-n", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--kl-v", type=int, nargs="+", default=[32_768, 65_536, 131_072, 262_144])
    ap.add_argument("--kl-n-at", type=int, default=2048, help="N of the V sweep")
    ap.add_argument("--kl-v-at", type=int, default=151_936, help="V of the N sweep")
    ap.add_argument("--kl-d", type=int, default=256)
    ap.add_argument("--chunk-v", type=int, default=8192)
    ap.add_argument("--max-ref-gib", type=float, default=4.0, help="time the reference only below this temp")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help=f"tiny smoke run: {QUICK}")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def main(argv=None):
    args = parse_args(argv)
    load0, started = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    log = lambda msg: print(msg, flush=True)
    log(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; load average "
        f"{' '.join(f'{x:.2f}' for x in load0)}")
    os.makedirs(args.out_dir, exist_ok=True)
    md_path = os.path.join(args.out_dir, "cost_curves_cpu.md")
    fmt = lambda load: " ".join(f"{x:.2f}" for x in load)
    body = []
    if "rollout" in args.parts:
        rows = rollout_points(args, log)
        plot_rollout(os.path.join(args.out_dir, "cost_curves_rollout_cpu.png"), rows)
        body += ["## Rollout throughput", "",
                 f"Benchmark model of benchmarks/rollout.py ({args.layers} layers, hidden {args.hidden}, vocab "
                 f"{args.vocab}), prompts of {args.prompt} tokens, "
                 f"temperature 1, best of {args.reps} after a first call; transformers where batch x length <= "
                 f"{args.baseline_max_tokens}" + (" (skipped: --no-baseline)" if args.no_baseline else "")
                 + f", best of {args.baseline_reps} after a warm-up.", "", *rollout_table(rows), "",
                 "![rollout](cost_curves_rollout_cpu.png)", ""]
    if "kl" in args.parts:
        rows = kl_points(args, log)
        plot_kl(os.path.join(args.out_dir, "cost_curves_kl_cpu.png"), rows, args)
        body += ["## Fused reverse KL: value and grad", "",
                 f"fp32, D = E = {args.kl_d}, chunk_v {args.chunk_v}; N sweep at V = {args.kl_v_at}, V sweep at "
                 f"N = {args.kl_n_at}; temp = compiled temporaries (memory_analysis); median of {args.reps} "
                 f"alternating calls; reference timed only under {args.max_ref_gib:g} GiB of temporaries.", "",
                 *kl_table(rows), "", "![fused KL](cost_curves_kl_cpu.png)", ""]
    load1 = os.getloadavg()
    head = ["# Cost curves", "",
            f"- command: `python benchmarks/cost_curves.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
            f"- commit {_sibling('opd_iteration').commit()}; {started:%Y-%m-%d %H:%M} UTC; jax {jax.__version__} on "
            f"{jax.devices()[0].platform}, {os.cpu_count()} cores",
            f"- load average before {fmt(load0)}, after {fmt(load1)}", ""]
    with open(md_path, "w", encoding="utf-8") as f:
        f.write("\n".join(head + body))
    log("\n".join(body))
    log(f"wrote {md_path}")


if __name__ == "__main__":
    main()
