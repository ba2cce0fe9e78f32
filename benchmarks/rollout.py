"""Rollout throughput: our jit sampler vs transformers' generate (and Tunix if installed).

    PYTHONPATH=. python benchmarks/rollout.py            # ~2-4 minutes on 2 CPU cores

Batch 16, prompt 16, 128 new tokens, temperature 1 (top_k 0, top_p 1), every row runs to
128 tokens (no stop ids here; eos masked in transformers), on a tiny Qwen3-style model
(4 layers, hidden 256, 4 heads, 2 kv heads, vocab 32k) with the same weights on both sides
(a random HF checkpoint, imported with `load_pretrained`). Prints new tokens per second,
the ratio, the one-time compile time, and the compile count of a second call with another
temperature, top-p and stop ids (expected 0).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np


def hf_checkpoint(path, vocab, seed=0):
    import torch
    import transformers
    config = transformers.AutoConfig.for_model(
        model_type="qwen3", vocab_size=vocab, hidden_size=256, intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
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


def bench_ours(path, prompts, new, repeats):
    from opd_jax.models import load_pretrained
    from opd_jax.rollout import generate
    model = load_pretrained(path)
    kw = dict(max_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0)

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
    steady = time_best(lambda: run(seed=1, temperature=0.9, top_p=0.95,
                                   stop_token_ids=[32_000]), repeats)
    n_compiles = len(compiles)
    steady = min(steady, time_best(lambda: run(seed=2), repeats))
    return steady, first - steady, n_compiles


def bench_hf(model, prompts, new, repeats):
    import torch
    ids = torch.tensor(prompts, dtype=torch.long)
    gen = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
               min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None

    def run():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)
        assert out.shape[1] == ids.shape[1] + new, out.shape
    run()  # warm up
    return time_best(run, repeats)


def bench_tunix(path, prompts, new, repeats):
    """Tunix's sampler on the same checkpoint; None (with the reason) when unavailable."""
    try:
        from tunix_bench import run_tunix  # benchmarks/tunix_bench.py
    except ImportError as e:
        return None, f"tunix unavailable: {e}"
    try:
        return run_tunix(path, prompts, new, repeats), ""
    except Exception as e:  # noqa: BLE001 - a benchmark-only extra; report and go on
        return None, f"tunix failed: {type(e).__name__}: {str(e)[:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, args.vocab, (args.batch, args.prompt)).tolist()
    tokens = args.batch * args.new
    with tempfile.TemporaryDirectory() as path:
        hf = hf_checkpoint(path, args.vocab)
        ours, compile_s, n_compiles = bench_ours(path, prompts, args.new, args.repeats)
        theirs = bench_hf(hf, prompts, args.new, args.repeats)
        tunix, why = bench_tunix(path, prompts, args.new, args.repeats)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}, "
          f"{os.cpu_count()} cpus; batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, temperature 1, vocab {args.vocab}")
    print(f"opd_jax rollout : {tokens / ours:9.1f} tok/s  ({ours:.3f} s best of "
          f"{args.repeats})")
    print(f"transformers    : {tokens / theirs:9.1f} tok/s  ({theirs:.3f} s)")
    print(f"ratio ours / transformers: {theirs / ours:.2f}x")
    if tunix is not None:
        print(f"tunix sampler   : {tokens / tunix:9.1f} tok/s  ({tunix:.3f} s); "
              f"ours / tunix: {tunix / ours:.2f}x")
    else:
        print(f"tunix sampler   : not measured ({why})")
    print(f"compile (first call minus a warm call): {compile_s:.1f} s; compiles on a call "
          f"with new temperature/top-p/stop ids/seed: {n_compiles}")


if __name__ == "__main__":
    main()
