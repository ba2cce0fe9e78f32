"""GPU benchmark of the fused kernels (H200): Triton block-size sweep, then "triton" vs "xla" vs "reference", bf16.

    bash benchmarks/gpu_kernels.sh 2>&1 | tee benchmarks/results/gpu_kernels_h200.txt   # ~8 min
    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --check     # small compiled-Triton correctness check
    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --no-sweep  # the comparison only (table as it is)
    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --sweep-only

Needs one idle NVIDIA GPU (an H200's 141 GB: "reference" at T=16384 holds tens of GB of
logits) and jax with CUDA; no opd_jax install. Measures the dense bf16 GEMM rate first
(8192^3), prints a time estimate, then:

Sweep (per benchmark shape T in {4096, 16384}, D = E = 4096, V = 151,936): coordinate
descent over the "triton" knobs (block_n, block_v, block_d, chunk_v, vocab_splits; SPACE)
from the untuned defaults, each config timed on value-and-grad of the mean fused reverse
KL (median ms, TFLOP/s, % of the GEMM rate); a config whose loss or gradient norms differ
from the first config's is rejected. The fastest goes into
pallas_kernels/tuned/triton_<device>.json under its shape class (pallas_kernels/tuning.py),
which "triton" reads whenever the caller passes no block sizes. Each shape runs in its own
process, within --sweep-budget-s (a config started before the budget ran out finishes).

Comparison: median ms of the forward and of forward+backward, TFLOP/s, % of the GEMM rate,
peak device memory and its ratio to "reference"; "triton" without block arguments (the
table just written). FLOPs: forward 2TV(D+E); forward+backward 2TV(D+E) + 2TV(D+E) + 4TVD
(the backward recomputes). Each (T, impl) runs in its own process so peak_bytes_in_use is
that config's own. Goals: forward >= 70 %, forward+backward >= 55 % of the GEMM rate,
memory <= 1/8 reference.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

V = 151_936
# Candidate values per knob, tried in tuning.KNOBS order from tuning.DEFAULTS: 10 configs a
# shape (vocab_splits 0 is the defaults' own).
SPACE = {"block_n": [32, 64, 128], "block_v": [64, 128, 256], "block_d": [32, 64, 128],
         "chunk_v": [4096, 8192, 16384], "vocab_splits": [0, 2, 8]}
COMPILE_GUESS_S = 8.0      # per config, for the printed estimate only
TRITON_SHARE_GUESS = 0.35  # fraction of the GEMM rate assumed by the estimate


def _times_ms(fn, *args, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _median_ms(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    return statistics.median(_times_ms(fn, *args, reps=reps))


def gemm_tflops(size=8192):
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    ms = _median_ms(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
                    a, b, reps=20)
    return 2 * size**3 / ms / 1e9


def _problem(t, d, v=V, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(t), 4)
    return (jax.random.normal(ks[0], (t, d), dtype), (jax.random.normal(ks[1], (d, v)) * 0.02).astype(dtype),
            jax.random.normal(ks[2], (t, d), dtype), (jax.random.normal(ks[3], (d, v)) * 0.02).astype(dtype))


def fwd_bwd_flops(t, d, v=V):
    return 2 * (2 * t * v * 2 * d) + 4 * t * v * d


def _mean_kl(h_t, w_t, impl, blocks, interpret=None):
    from pallas_kernels import fused_reverse_kl
    return lambda hs, ws: jnp.mean(fused_reverse_kl(hs, ws, h_t, w_t, implementation=impl, interpret=interpret,
                                                    **blocks))


def run_one(t, d, impl, blocks):
    h_s, w_s, h_t, w_t = _problem(t, d)
    loss = _mean_kl(h_t, w_t, impl, blocks)
    fwd = jax.jit(loss)
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    ms_f = _median_ms(fwd, h_s, w_s)
    ms_fb = _median_ms(fwd_bwd, h_s, w_s)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(fwd_ms=ms_f, fwd_bwd_ms=ms_fb, peak_gib=stats.get("peak_bytes_in_use", float("nan")) / 2**30,
                loss=float(fwd(h_s, w_s)))


def time_blocks(problem, blocks, reps, interpret=None):
    """Value-and-grad of the mean KL with these triton knobs: median ms, first call s, checksums."""
    h_s, w_s, h_t, w_t = problem
    fn = jax.jit(jax.value_and_grad(_mean_kl(h_t, w_t, "triton", blocks, interpret), argnums=(0, 1)))
    t0 = time.perf_counter()
    loss, (dh, dw) = jax.block_until_ready(fn(h_s, w_s))
    first = time.perf_counter() - t0
    norm = lambda x: float(jnp.linalg.norm(x.astype(jnp.float32)))
    return dict(ms=statistics.median(_times_ms(fn, h_s, w_s, reps=reps)), first_s=first, loss=float(loss),
                dh_norm=norm(dh), dw_norm=norm(dw))


def agrees(r, ref, tol):
    """Same loss and gradient norms as `ref` within tol (relative to max(1, |ref|))."""
    return all(abs(r[k] - ref[k]) <= tol * max(1.0, abs(ref[k])) for k in ("loss", "dh_norm", "dw_norm"))


def best_result(results, tol):
    """The fastest successful result that agrees with the first successful one (None if none)."""
    ok = [r for r in results if "ms" in r]
    good = [r for r in ok if agrees(r, ok[0], tol)] if ok else []
    return min(good, key=lambda r: r["ms"]) if good else None


def sweep_shape(problem, space, *, reps, budget_s, tol, interpret=None, emit=lambda r: None):
    """Coordinate descent over the triton knobs from tuning.DEFAULTS: each knob in turn takes
    the fastest of its candidates (others at the best so far). Returns every result tried
    ({"blocks", "ms", "first_s", checksums} or {"blocks", "error"}), in order."""
    from pallas_kernels import tuning
    t_start, results, seen = time.perf_counter(), [], set()

    def run(blocks):
        key = tuple(blocks[k] for k in tuning.KNOBS)
        if key in seen:
            return
        seen.add(key)
        try:
            tuning.check_entry(blocks, "candidate")
            r = {"blocks": blocks, **time_blocks(problem, blocks, reps, interpret)}
        except Exception as e:  # noqa: BLE001 - a config Triton cannot compile is a sweep result
            r = {"blocks": blocks, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
        results.append(r)
        emit(r)

    run(dict(tuning.DEFAULTS))
    for knob in tuning.KNOBS:
        for value in space.get(knob, ()):
            if time.perf_counter() - t_start > budget_s:
                return results
            best = best_result(results, tol)
            run({**(best["blocks"] if best else tuning.DEFAULTS), knob: value})
    return results


def table_entry(best, default, t, d, v, dtype, gemm, n_tried):
    """The table's entry for a shape: the best knobs, and how they were measured."""
    measured = {"fwd_bwd_ms": round(best["ms"], 3), "shape_TxDxV": [t, d, v], "dtype": jnp.dtype(dtype).name,
                "configs_tried": n_tried, "date": datetime.date.today().isoformat(), "jax": jax.__version__}
    if default is not None:
        measured["default_ms"] = round(default["ms"], 3)
    if gemm:
        measured["pct_of_gemm"] = round(100 * fwd_bwd_flops(t, d, v) / best["ms"] / 1e9 / gemm, 1)
    return {**best["blocks"], "measured": measured}


def check():
    """Compiled (not interpret) Triton kernels against the reference on a small bf16 problem."""
    from pallas_kernels import fused_clipped_log_ratio, fused_reverse_kl
    h_s, w_s, h_t, w_t = _problem(300, 256)
    y = jax.random.randint(jax.random.key(9), (300,), 0, V)
    for op in ("kl", "ratio"):
        def f(impl):
            if op == "kl":
                return lambda hs, ws: jnp.sum(jnp.sin(fused_reverse_kl(hs, ws, h_t, w_t, implementation=impl)))
            return lambda hs, ws: jnp.sum(fused_clipped_log_ratio(hs, ws, h_t, w_t, y, r_max=2.0,
                                                                   implementation=impl)[0])
        v0, g0 = jax.jit(jax.value_and_grad(f("reference"), (0, 1)))(h_s, w_s)
        v1, g1 = jax.jit(jax.value_and_grad(f("triton"), (0, 1)))(h_s, w_s)
        errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(g0, g1)]
        print(f"check {op}: value ref {float(v0):.6f} triton {float(v1):.6f}; max |grad diff| {errs}", flush=True)


def estimate_s(ts, d, gemm, args):
    """(sweep, comparison) seconds, assuming TRITON_SHARE_GUESS of the GEMM rate."""
    call = lambda t: fwd_bwd_flops(t, d) / (TRITON_SHARE_GUESS * gemm * 1e12)
    n_cfg = 1 + sum(len(v) - 1 for v in SPACE.values())
    sweep = sum(min(n_cfg * (COMPILE_GUESS_S + (1 + args.reps) * call(t)),
                    args.sweep_budget_s + COMPILE_GUESS_S + (1 + args.reps) * call(t)) + 10 for t in ts)
    compare = sum(len(args.impls) * (15 + 12 * call(t)) for t in ts)
    return sweep, compare


def sweep(args, gemm):
    from pallas_kernels import tuning
    kind = jax.devices()[0].device_kind
    path = args.table or os.path.join(tuning.TABLE_DIR, tuning.device_file_name(kind))
    tol = 2e-2  # bf16: the loss and gradient norms agree to ~1e-3 between block shapes
    print(f"sweep: {', '.join(f'{k} {v}' for k, v in SPACE.items())}; reps {args.reps}; "
          f"budget {args.sweep_budget_s:.0f} s a shape", flush=True)
    print(f"{'T':>6} {'block_n':>7} {'block_v':>7} {'block_d':>7} {'splits':>6} {'chunk_v':>7} {'ms':>8} "
          f"{'TF/s':>6} {'%gemm':>6} {'first s':>7}", flush=True)
    entries = {}
    for t in args.t:
        cmd = [sys.executable, __file__, "--sweep-one", str(t), "--d", str(args.d), "--reps", str(args.reps),
               "--sweep-budget-s", str(args.sweep_budget_s)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = []
        for line in proc.stdout:
            if not line.startswith("RESULT "):
                continue
            r = json.loads(line[len("RESULT "):])
            results.append(r)
            b = r["blocks"]
            head = (f"{t:>6} {b['block_n']:>7} {b['block_v']:>7} {b['block_d']:>7} {b['vocab_splits']:>6} "
                    f"{b['chunk_v']:>7}")
            if "error" in r:
                print(f"{head} FAILED: {r['error']}", flush=True)
                continue
            tf = fwd_bwd_flops(t, args.d) / r["ms"] / 1e9
            print(f"{head} {r['ms']:>8.1f} {tf:>6.1f} {100 * tf / gemm:>5.0f}% {r['first_s']:>7.1f}", flush=True)
        err = proc.stderr.read()
        if proc.wait() != 0:
            print(f"{t:>6} sweep process exited {proc.returncode}: {(err.strip().splitlines() or ['?'])[-1][:200]}",
                  flush=True)
        best = best_result(results, tol)
        if best is None:
            print(f"{t:>6} no usable config; the table keeps its old entry for this shape", flush=True)
            continue
        default = results[0] if results and "ms" in results[0] else None
        rejected = [r for r in results if "ms" in r and r is not best and not agrees(r, best, tol)]
        line = f"{t:>6} best {best['blocks']}: {best['ms']:.1f} ms"
        if default:
            line += f" (defaults {default['ms']:.1f} ms: {default['ms'] / best['ms']:.2f}x faster)"
        if rejected:
            line += f"; {len(rejected)} rejected (loss or gradient norms differ)"
        print(line, flush=True)
        cls = tuning.shape_class(t, args.d, args.d, V, jnp.bfloat16)
        entries[cls] = table_entry(best, default, t, args.d, V, jnp.bfloat16, gemm, len(results))
    if entries:
        tuning.write_entries(path, kind, entries)
        print(f"wrote {sorted(entries)} for {kind!r} to {path}", flush=True)


def compare(args, gemm, blocks):
    print(f"{'T':>6} {'impl':<10} {'fwd ms':>8} {'fwd TF/s':>8} {'%gemm':>6} {'f+b ms':>8} {'f+b TF/s':>8} "
          f"{'%gemm':>6} {'peak GiB':>8} {'mem/ref':>7}")
    for t in args.t:
        ref_peak = None
        for impl in sorted(args.impls, key=lambda i: i != "reference"):  # reference first: the memory baseline
            proc = subprocess.run([sys.executable, __file__, "--one", f"{t},{impl}", "--d", str(args.d),
                                   "--blocks", json.dumps(blocks)], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{t:>6} {impl:<10} FAILED: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            f_fl = 2 * t * V * 2 * args.d
            fb_fl = fwd_bwd_flops(t, args.d)
            tf_f, tf_fb = f_fl / r["fwd_ms"] / 1e9, fb_fl / r["fwd_bwd_ms"] / 1e9
            ref_peak = r["peak_gib"] if impl == "reference" else ref_peak
            ratio = r["peak_gib"] / ref_peak if ref_peak else float("nan")
            print(f"{t:>6} {impl:<10} {r['fwd_ms']:>8.1f} {tf_f:>8.1f} {100 * tf_f / gemm:>5.0f}% "
                  f"{r['fwd_bwd_ms']:>8.1f} {tf_fb:>8.1f} {100 * tf_fb / gemm:>5.0f}% {r['peak_gib']:>8.2f} "
                  f"{ratio:>7.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--impls", nargs="+", default=["triton", "xla", "reference"])
    parser.add_argument("--blocks", default="{}", help="explicit knobs for the comparison (JSON); "
                        "default none: triton reads its tuned table")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per sweep config")
    parser.add_argument("--sweep-budget-s", type=float, default=90.0)
    parser.add_argument("--table", default=None, help="table file to write (default "
                        "pallas_kernels/tuned/triton_<device>.json)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-only", action="store_true")
    parser.add_argument("--one", default=None, help="internal: T,impl for a single child run")
    parser.add_argument("--sweep-one", type=int, default=None, help="internal: sweep one T in this process")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--gemm-size", type=int, default=8192)
    args = parser.parse_args()
    blocks = json.loads(args.blocks)
    if args.check:
        return check()
    if args.one:
        t, impl = args.one.split(",")
        print(json.dumps(run_one(int(t), args.d, impl, blocks if impl != "reference" else {})))
        return
    if args.sweep_one is not None:
        emit = lambda r: print("RESULT " + json.dumps(r), flush=True)
        sweep_shape(_problem(args.sweep_one, args.d), SPACE, reps=args.reps, budget_s=args.sweep_budget_s,
                    tol=2e-2, emit=emit)
        return
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind} D=E={args.d} V={V} bf16; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    gemm = gemm_tflops(args.gemm_size)
    print(f"dense bf16 GEMM {args.gemm_size}^3: {gemm:.1f} TFLOP/s", flush=True)
    est_sweep, est_compare = estimate_s(args.t, args.d, gemm, args)
    print(f"estimate (triton at {TRITON_SHARE_GUESS:.0%} of the GEMM rate, {COMPILE_GUESS_S:.0f} s compile a "
          f"config): sweep {0 if args.no_sweep else est_sweep:.0f} s, comparison "
          f"{0 if args.sweep_only else est_compare:.0f} s", flush=True)
    if not args.no_sweep:
        sweep(args, gemm)
    if not args.sweep_only:
        compare(args, gemm, blocks)


if __name__ == "__main__":
    main()
