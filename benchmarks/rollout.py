"""Rollout throughput: our jit sampler vs transformers' generate (and Tunix if installed).

    PYTHONPATH=. python benchmarks/rollout.py            # ~3-6 minutes on 2 quiet CPU cores
    PYTHONPATH=.:/tmp/tunix_site python benchmarks/rollout.py   # with Tunix (see tunix_bench.py)

Batch 16, prompt 16, 128 new tokens, every row runs to 128 tokens (no stop ids here; eos
masked in transformers), on a tiny Qwen3-style model (4 layers, hidden 256, 4 heads, 2 kv
heads, vocab 32k) with the same weights on both sides (a random HF checkpoint, imported
with `load_pretrained`). Two settings, each side measured in the same run: temperature 1
sampling (top_k 0, top_p 1) and greedy. Prints new tokens per second and the ratios, the
one-time compile time (in this process, and in --compile-runs fresh processes with their
median: a process compiles once), the compile count of a second call with another temperature, top-p,
top-k, stop ids and seed (expected 0), and the physical floor: a decode step must read
every weight once, so tokens/s x weight bytes / batch is the achieved weight-read rate,
printed as a fraction of this machine's memory bandwidth measured in the same run (a
streaming sum over 512 MiB). The load average is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx


def hf_checkpoint(path, vocab, seed=0, *, layers=4, hidden=256):
    """The benchmark model (4 layers, hidden 256 unless told), random, saved at `path`."""
    import torch
    import transformers
    config = transformers.AutoConfig.for_model(
        model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        rope_theta=1_000_000.0, tie_word_embeddings=False, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def time_best(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memory_bandwidth_gbs(mib=512, repeats=5):
    """Best streaming-read rate (GB/s) of a jitted sum over `mib` MiB of fp32."""
    import jax.numpy as jnp
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    best = time_best(lambda: jax.block_until_ready(total(x)), repeats)
    return x.nbytes / best / 1e9


def bench_ours(path, prompts, new, repeats, temperature=1.0):
    from opd_jax.models import load_pretrained
    from opd_jax.rollout import generate
    model = load_pretrained(path)
    kw = dict(max_new_tokens=new, temperature=temperature, top_k=0, top_p=1.0)

    def run(**extra):
        res = generate(model, prompts, **{**kw, **extra})
        jax.block_until_ready(res.batch.tokens_BxL)
        return res
    t = time.perf_counter()
    res = run(seed=0)
    first = time.perf_counter() - t
    assert all(len(r) == new for r in res.tokens), [len(r) for r in res.tokens]
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: compiles.append(e) if e.endswith("backend_compile_duration") else None)
    steady = time_best(lambda: run(seed=1, temperature=0.9, top_p=0.95, top_k=40,
                                   stop_token_ids=[32_000]), 1)
    n_compiles = len(compiles)
    steady = time_best(lambda: run(seed=2), repeats)
    return steady, first - steady, n_compiles, weight_read_bytes(model, len(prompts))


def compile_seconds(path, prompts, new, temperature, runs):
    """First-call compile seconds (first call minus a warm call) of `runs` fresh processes,
    each loading the checkpoint and timing two generate calls: a process compiles once,
    so one number per process, and the spread is the machine's."""
    import json
    import subprocess
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from rollout import "
            "first_call_compile as f; print(json.dumps(f(*json.loads(sys.argv[2]))))")
    out = []
    for _ in range(runs):
        res = subprocess.run([sys.executable, "-c", code, os.path.dirname(
            os.path.abspath(__file__)), json.dumps([path, prompts, new, temperature])],
            capture_output=True, text=True, check=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def first_call_compile(path, prompts, new, temperature):
    """In this (fresh) process: the first generate call's seconds minus a warm call's."""
    from opd_jax.models import load_pretrained
    from opd_jax.rollout import generate
    model = load_pretrained(path)
    kw = dict(max_new_tokens=new, temperature=temperature, top_k=0, top_p=1.0)
    times = []
    for seed in (0, 1):
        t = time.perf_counter()
        jax.block_until_ready(generate(model, prompts, seed=seed, **kw).batch.tokens_BxL)
        times.append(time.perf_counter() - t)
    return times[0] - times[1]


def weight_read_bytes(model, batch):
    """What one decode step of `batch` rows must read of the weights: every nnx.Param,
    except that an untied embedding table is only gathered (B rows), not read whole."""
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if not model.config.tie_embeddings:
        embed = model.embed[...]
        weight_bytes -= embed.nbytes - batch * embed.shape[1] * embed.dtype.itemsize
    return weight_bytes


def bench_hf(model, prompts, new, repeats, temperature=1.0):
    import torch
    ids = torch.tensor(prompts, dtype=torch.long)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                if temperature > 0 else dict(do_sample=False))
    gen = dict(**sampling, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
               pad_token_id=0)
    model.generation_config.eos_token_id = None

    def run():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)
        assert out.shape[1] == ids.shape[1] + new, out.shape
    run()  # warm up
    return time_best(run, repeats)


def bench_tunix(path, prompts, new, repeats, temperature=1.0):
    """Tunix's sampler on the same checkpoint; None (with the reason) when unavailable."""
    try:
        from tunix_bench import run_tunix  # benchmarks/tunix_bench.py
    except ImportError as e:
        return None, f"tunix unavailable: {e}"
    try:
        return run_tunix(path, prompts, new, repeats, temperature=temperature), ""
    except Exception as e:  # noqa: BLE001 - a benchmark-only extra; report and go on
        return None, f"tunix failed: {type(e).__name__}: {str(e)[:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-runs", type=int, default=3,
                    help="fresh processes timing the first call's compile (median printed)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, args.vocab, (args.batch, args.prompt)).tolist()
    tokens = args.batch * args.new
    load0 = os.getloadavg()
    bandwidth = memory_bandwidth_gbs()
    rows = []
    with tempfile.TemporaryDirectory() as path:
        hf = hf_checkpoint(path, args.vocab)
        for name, temp in (("T=1 sampling", 1.0), ("greedy", 0.0)):
            ours, compile_s, n_compiles, weight_bytes = bench_ours(path, prompts, args.new,
                                                                   args.repeats, temp)
            theirs = bench_hf(hf, prompts, args.new, args.repeats, temp)
            tunix, why = bench_tunix(path, prompts, args.new, args.repeats, temp)
            fresh = compile_seconds(path, prompts, args.new, temp, args.compile_runs)
            rows.append((name, ours, theirs, tunix, why, compile_s, n_compiles, weight_bytes,
                         fresh))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}, "
          f"{os.cpu_count()} cpus; batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, vocab {args.vocab}; load average "
          f"{load0[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"memory bandwidth (streaming sum over 512 MiB, same run): {bandwidth:.1f} GB/s")
    for name, ours, theirs, tunix, why, compile_s, n_compiles, weight_bytes, fresh in rows:
        steps_per_s = args.new / ours
        achieved = steps_per_s * weight_bytes / 1e9
        print(f"--- {name}")
        print(f"opd_jax rollout : {tokens / ours:9.1f} tok/s  ({ours:.3f} s best of "
              f"{args.repeats}); weights read {achieved:.1f} GB/s = "
              f"{achieved / bandwidth:.0%} of the measured bandwidth "
              f"({weight_bytes / 2**20:.1f} MiB per decode step)")
        print(f"transformers    : {tokens / theirs:9.1f} tok/s  ({theirs:.3f} s)")
        print(f"ratio ours / transformers: {theirs / ours:.2f}x")
        if tunix is not None:
            print(f"tunix sampler   : {tokens / tunix:9.1f} tok/s  ({tunix:.3f} s); "
                  f"ours / tunix: {tunix / ours:.2f}x")
        else:
            print(f"tunix sampler   : not measured ({why})")
        print(f"compile (first call minus a warm call): {compile_s:.1f} s in this process"
              + (f"; {len(fresh)} fresh processes: median {float(np.median(fresh)):.2f} s ("
                 + ", ".join(f"{x:.2f}" for x in fresh) + ")" if fresh else "")
              + f"; compiles on a call with new temperature/top-k/top-p/stop ids/seed: "
              f"{n_compiles}")


if __name__ == "__main__":
    main()
