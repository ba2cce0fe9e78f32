"""GPU benchmark of the fused kernels (H200): "triton" vs "xla" vs "reference", bf16.

    PYTHONPATH=. python3 benchmarks/gpu_kernels.py            # everything (via gpu_kernels.sh)
    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --check    # small compiled-Triton correctness check

Measures the dense bf16 GEMM rate first (8192^3), then for T in {4096, 16384}, D = E =
4096, V = 151,936: median ms of the forward and of forward+backward of the mean fused
reverse KL, TFLOP/s, the fraction of the GEMM rate, and peak device memory. FLOPs:
forward 2TV(D+E); forward+backward 2TV(D+E) + 2TV(D+E) + 4TVD (backward recomputes).
Each (T, impl) runs in its own process so peak_bytes_in_use is that config's own.
Goals: forward >= 70 %, forward+backward >= 55 % of the GEMM rate, memory <= 1/8 reference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

V = 151_936


def _median_ms(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_tflops(size=8192):
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    ms = _median_ms(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
                    a, b, reps=20)
    return 2 * size**3 / ms / 1e9


def _problem(t, d):
    ks = jax.random.split(jax.random.key(t), 4)
    return (jax.random.normal(ks[0], (t, d), jnp.bfloat16), (jax.random.normal(ks[1], (d, V)) * 0.02).astype(jnp.bfloat16),
            jax.random.normal(ks[2], (t, d), jnp.bfloat16), (jax.random.normal(ks[3], (d, V)) * 0.02).astype(jnp.bfloat16))


def run_one(t, d, impl, blocks):
    from pallas_kernels import fused_reverse_kl
    h_s, w_s, h_t, w_t = _problem(t, d)
    loss = lambda hs, ws: jnp.mean(fused_reverse_kl(hs, ws, h_t, w_t, implementation=impl, **blocks))
    fwd = jax.jit(loss)
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    ms_f = _median_ms(fwd, h_s, w_s)
    ms_fb = _median_ms(fwd_bwd, h_s, w_s)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(fwd_ms=ms_f, fwd_bwd_ms=ms_fb, peak_gib=stats.get("peak_bytes_in_use", float("nan")) / 2**30,
                loss=float(fwd(h_s, w_s)))


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--impls", nargs="+", default=["triton", "xla", "reference"])
    parser.add_argument("--blocks", default='{"block_n": 64, "block_v": 128, "block_d": 64, "chunk_v": 8192}')
    parser.add_argument("--one", default=None, help="internal: T,impl for a single child run")
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
    print(f"jax {jax.__version__} {jax.devices()[0].device_kind} D=E={args.d} V={V} bf16 blocks={blocks}")
    peak = gemm_tflops(args.gemm_size)
    print(f"dense bf16 GEMM {args.gemm_size}^3: {peak:.1f} TFLOP/s", flush=True)
    print(f"{'T':>6} {'impl':<10} {'fwd ms':>8} {'fwd TF/s':>8} {'%gemm':>6} {'f+b ms':>8} {'f+b TF/s':>8} "
          f"{'%gemm':>6} {'peak GiB':>8} {'mem/ref':>7}")
    for t in args.t:
        ref_peak = None
        for impl in sorted(args.impls, key=lambda i: i != "reference"):  # reference first: the memory baseline
            proc = subprocess.run([sys.executable, __file__, "--one", f"{t},{impl}", "--d", str(args.d),
                                   "--blocks", args.blocks], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{t:>6} {impl:<10} FAILED: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            f_fl = 2 * t * V * 2 * args.d
            fb_fl = 2 * f_fl + 4 * t * V * args.d
            tf_f, tf_fb = f_fl / r["fwd_ms"] / 1e9, fb_fl / r["fwd_bwd_ms"] / 1e9
            ref_peak = r["peak_gib"] if impl == "reference" else ref_peak
            ratio = r["peak_gib"] / ref_peak if ref_peak else float("nan")
            print(f"{t:>6} {impl:<10} {r['fwd_ms']:>8.1f} {tf_f:>8.1f} {100 * tf_f / peak:>5.0f}% "
                  f"{r['fwd_bwd_ms']:>8.1f} {tf_fb:>8.1f} {100 * tf_fb / peak:>5.0f}% {r['peak_gib']:>8.2f} "
                  f"{ratio:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
