"""Multi-turn episode throughput: the episode runner against an earlier one from git history.

    PYTHONPATH=. python benchmarks/episodes.py --baseline-ref dcf733e   # ~5 minutes, 2 cores

Plays the agent domain's testbed family (`tool_chain`, multi-turn tool lookups) at its
evaluation difficulty with `builtin:base`, the testbed's sampling (224 new tokens a turn,
up to 10 turns, temperature 1), B episodes per call. The baseline is
`opd_jax/trainers/episodes.py` (the runner's earlier home) as it was at `--baseline-ref` (loaded from git, run
against today's rollout engine): at dcf733e it re-prefilled each episode's whole context
every turn through `generate`, with one batch of the live episodes per turn. Both run in
the same process, alternating, `--repeats` times each after one warm-up call (compiles),
on the same tasks with other seeds per call. Prints sampled tokens per second (best and
median), the first call (compiles included), and the machine's load average.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time


def load_baseline(ref: str):
    src = subprocess.run(["git", "show", f"{ref}:opd_jax/trainers/episodes.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "episodes_baseline.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("episodes_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod       # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-ref", default="dcf733e")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--family", default="tool_chain")
    ap.add_argument("--out", default="benchmarks/results/episodes_cpu.txt")
    args = ap.parse_args()

    from opd_jax import envs
    from opd_jax.models import synthetic_tokenizer
    from opd_jax import recipes as tb
    from opd_jax.models import ModelRef
    from opd_jax.episodes import runner as ours

    base = load_baseline(args.baseline_ref)
    model = ModelRef("builtin:base").load()
    tok = synthetic_tokenizer()
    domain = envs.get_family(args.family).domain
    tasks = list(envs.TaskSource(args.family, size=args.batch, seed=0, effort="high",
                                 difficulty=tb.EVAL_DIFFICULTY[domain], split="eval"))
    kw = dict(max_new_tokens=tb.SAMPLING["max_new_tokens"], max_turns=tb.SAMPLING["max_turns"],
              temperature=1.0)
    runners = {"ours": (ours.play, ours.SamplingConfig(**kw)),
               f"baseline@{args.baseline_ref}": (base.play, base.SamplingConfig(**kw))}
    times = {k: [] for k in runners}
    first, tokens, turns, reward = {}, {k: [] for k in runners}, {}, {}
    for name, (play, sampling) in runners.items():
        t = time.perf_counter()
        eps = play(model, tok, tasks, sampling, seed=0)
        first[name] = time.perf_counter() - t
        turns[name] = statistics.mean(e.turns for e in eps)
        reward[name] = statistics.mean(e.reward for e in eps)
    for r in range(args.repeats):
        for name, (play, sampling) in runners.items():
            t = time.perf_counter()
            eps = play(model, tok, tasks, sampling, seed=r + 1)
            times[name].append(time.perf_counter() - t)
            tokens[name].append(sum(e.sampled_tokens for e in eps))
    load = os.getloadavg()
    lines = [f"# python {' '.join(sys.argv)}",
             f"# commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}"
             f", {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
             f"# {args.family} (domain {domain}) difficulty {tb.EVAL_DIFFICULTY[domain]}, "
             f"B={args.batch}, {kw}",
             "| runner | first call s | best s | median s | tokens/s (best) | mean turns | mean reward |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    rate = {}
    for name in runners:
        best = min(times[name])
        rate[name] = tokens[name][times[name].index(best)] / best
        lines.append(f"| {name} | {first[name]:.1f} | {best:.2f} | "
                     f"{statistics.median(times[name]):.2f} | {rate[name]:.0f} | "
                     f"{turns[name]:.2f} | {reward[name]:.3f} |")
    names = list(runners)
    lines.append(f"\nours / baseline tokens/s: {rate[names[0]] / rate[names[1]]:.2f}x; "
                 f"first call: {first[names[1]] / first[names[0]]:.2f}x faster")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
