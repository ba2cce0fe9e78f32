"""CPU benchmark: "xla" (chunked, custom_vjp) against "reference" (full logits), same run.

    PYTHONPATH=. python benchmarks/fused_kl.py [--n 1024 4096] [--reps 3]

Prints, for value-and-grad of the mean fused reverse KL (per-token op "xla", and the
one-pass weighted loss "xla-onepass") and of a clipped-log-ratio loss: peak temporary
memory from jit(...).lower(...).compile().memory_analysis() and the median wall time,
with xla/reference ratios. Targets: >= 16x less temp memory, time <= 1.5x reference.
Timed calls alternate between implementations (the CPU is shared).
D=512 (student and teacher), V=151,936, fp32.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels import fused_clipped_log_ratio, fused_reverse_kl, fused_reverse_kl_loss

V = 151_936


def make_loss(kind: str, impl: str, chunk_v: int):
    if kind == "reverse_kl" and impl == "xla-onepass":
        def loss(h_s, w_s, h_t, w_t, y):
            weights = jnp.full(y.shape, 1.0 / y.shape[0], jnp.float32)
            return fused_reverse_kl_loss(h_s, w_s, h_t, w_t, weights, implementation="xla", block_n=32)
    elif kind == "reverse_kl":
        def loss(h_s, w_s, h_t, w_t, y):
            return jnp.mean(fused_reverse_kl(h_s, w_s, h_t, w_t, implementation=impl, chunk_v=chunk_v))
    else:
        def loss(h_s, w_s, h_t, w_t, y):
            lp_s, _, r = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, r_max=5.0, implementation=impl,
                                                 chunk_v=chunk_v)
            return -jnp.mean(r * lp_s)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def make_inputs(n: int, d: int, v: int = V):
    """(h_s, w_s, h_t, w_t, y) of one problem, fp32, seeded by n."""
    ks = jax.random.split(jax.random.key(n), 5)
    return (jax.random.normal(ks[0], (n, d)), jax.random.normal(ks[1], (d, v)) * 0.05,
            jax.random.normal(ks[2], (n, d)), jax.random.normal(ks[3], (d, v)) * 0.05,
            jax.random.randint(ks[4], (n,), 0, v))


def compile_all(fns: dict, args):
    """AOT-compile every impl: ({impl: executable}, {impl: temp bytes from memory_analysis()})."""
    compiled = {k: fn.lower(*args).compile() for k, fn in fns.items()}
    return compiled, {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}


def time_round_robin(compiled: dict, args, reps: int):
    """{impl: median seconds}, calls alternating between impls (fair under a shared, noisy CPU)."""
    times = {k: [] for k in compiled}
    for _ in range(reps):
        for k, c in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


def measure(fns: dict, args, reps: int):
    """AOT-compile every impl, then time them round-robin: {impl: (temp bytes, median s)}."""
    compiled, temps = compile_all(fns, args)
    times = time_round_robin(compiled, args, reps)
    return {k: (temps[k], times[k]) for k in fns}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-v", type=int, default=4748)  # 151,936 / 32
    parser.add_argument("--kinds", nargs="+", default=["reverse_kl", "clipped_log_ratio"])
    args = parser.parse_args()
    print(f"jax {jax.__version__} backend={jax.default_backend()} D={args.d} V={V} fp32 "
          f"reps={args.reps} chunk_v={args.chunk_v}")
    print(f"{'kernel':<18} {'N':>5} {'impl':<11} {'temp MiB':>9} {'median s':>9} {'mem ratio':>10} {'time ratio':>10}")
    for kind in args.kinds:
        for n in args.n:
            inputs = make_inputs(n, args.d)
            impls = ("reference", "xla", "xla-onepass") if kind == "reverse_kl" else ("reference", "xla")
            res = measure({i: make_loss(kind, i, args.chunk_v) for i in impls}, inputs, args.reps)
            t_ref, s_ref = res["reference"]
            print(f"{kind:<18} {n:>5} {'reference':<11} {t_ref / 2**20:>9.1f} {s_ref:>9.2f}", flush=True)
            for impl in impls[1:]:
                t_x, s_x = res[impl]
                print(f"{kind:<18} {n:>5} {impl:<11} {t_x / 2**20:>9.1f} {s_x:>9.2f} "
                      f"{t_ref / t_x:>9.1f}x {s_x / s_ref:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
