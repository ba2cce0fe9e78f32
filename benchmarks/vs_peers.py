"""Full-vocab reverse KL, value + backward, against what PyTorch users pick today (CPU).

    PYTHONPATH=. python benchmarks/vs_peers.py [--n 2048] [--reps 3]

Same problem everywhere: N=2048 tokens, D=256 (student and teacher), V=151,936, fp32,
loss = mean_n KL(p_s,n || p_t,n), gradient to h_s and W_s. Each contender runs in its own
process; after a warm-up call (compilation), the kernel's peak-RSS mark is reset
(/proc/self/clear_refs) and "peak MiB" is VmHWM - VmRSS over the timed calls, i.e. the
memory the loss itself needs above the inputs. Contenders:
  ours-xla          fused_reverse_kl (per-token custom_vjp, recompute backward);
                    ours-xla-cC: vocab chunk C (default 4748 = V/32)
  ours-xla-onepass  fused_reverse_kl_loss (gradient formed in the forward);
                    ours-xla-onepass-bB: token block B (default 32)
  liger-cN          Liger-Kernel LigerFusedLinearJSDLoss(beta=1, weight_hard_loss=0,
                    chunk_size=N, compiled=True): beta=1 is KL(student || teacher)
  trl               TRL GKDTrainer.generalized_jsd_loss(beta=1) on full logits h W^T
Peer packages are benchmark-only (pip install liger-kernel trl torch==2.13.0).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

V = 151_936


def _inputs(n, d):
    rng = np.random.default_rng(0)
    h_s = rng.standard_normal((n, d), np.float32)
    w_s = rng.standard_normal((d, V), np.float32) * 0.05
    h_t = rng.standard_normal((n, d), np.float32)
    w_t = rng.standard_normal((d, V), np.float32) * 0.05
    return h_s, w_s, h_t, w_t


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _time(step, reps):
    step()  # warm-up: compilation, allocator pools
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_kib("VmRSS")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return loss, (_rss_kib("VmHWM") - base) / 1024, statistics.median(times)


def _ours(impl, n, d, reps):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import fused_reverse_kl, fused_reverse_kl_loss
    h_s, w_s, h_t, w_t = (jnp.asarray(x) for x in _inputs(n, d))
    # "xla[-cCHUNK]" (vocab chunk, default 4748 = V/32), "xla-onepass[-bBLOCK]" (token block,
    # default 32): the chunk sizes to tune.
    knob = impl.rsplit("-", 1)[-1] if impl.count("-") >= (2 if "onepass" in impl else 1) else ""
    if impl.startswith("xla-onepass"):
        weights = jnp.full((n,), 1.0 / n, jnp.float32)
        block = int(knob[1:]) if knob.startswith("b") else 32
        loss_fn = lambda hs, ws: fused_reverse_kl_loss(hs, ws, h_t, w_t, weights, implementation="xla",
                                                       block_n=block)
    else:
        chunk = int(knob[1:]) if knob.startswith("c") else 4748
        loss_fn = lambda hs, ws: jnp.mean(fused_reverse_kl(hs, ws, h_t, w_t, implementation="xla", chunk_v=chunk))
    step_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))

    def step():
        value, grads = step_fn(h_s, w_s)
        jax.block_until_ready(grads)
        return float(value)
    return _time(step, reps)


def _torch_problem(n, d):
    import torch
    h_s, w_s, h_t, w_t = (torch.from_numpy(x) for x in _inputs(n, d))
    # Both peers take torch.nn.Linear-style weights [V, D].
    return h_s, w_s.T.contiguous(), h_t, w_t.T.contiguous()


def _liger(chunk, n, d, reps):
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    h_s0, w_s0, h_t, w_t = _torch_problem(n, d)
    labels = torch.zeros(n, dtype=torch.long)
    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0, chunk_size=chunk,
                                      compiled=True)

    def step():
        h_s, w_s = h_s0.clone().requires_grad_(), w_s0.clone().requires_grad_()
        loss = loss_fn(h_s, w_s, h_t, w_t, labels)
        loss.backward()
        return float(loss)
    return _time(step, reps)


def _trl(n, d, reps):
    import torch
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    h_s0, w_s0, h_t, w_t = _torch_problem(n, d)

    def step():
        h_s, w_s = h_s0.clone().requires_grad_(), w_s0.clone().requires_grad_()
        with torch.no_grad():
            teacher_logits = (h_t @ w_t.T)[None]
        # batchmean divides by the batch dim (1 here): divide by n for the per-token mean.
        loss = GKDTrainer.generalized_jsd_loss((h_s @ w_s.T)[None], teacher_logits, beta=1.0) / n
        loss.backward()
        return float(loss)
    return _time(step, reps)


def worker(name, n, d, reps):
    if name.startswith("ours-"):
        return _ours(name[len("ours-"):], n, d, reps)
    if name.startswith("liger-c"):
        return _liger(int(name[len("liger-c"):]), n, d, reps)
    if name == "trl":
        return _trl(n, d, reps)
    raise ValueError(f"unknown contender {name!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--contenders", nargs="+",
                        default=["ours-xla", "ours-xla-onepass", "liger-c256", "liger-c1024", "trl"])
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.d, args.reps)))
        return
    import os
    print(f"N={args.n} D={args.d} V={V} fp32 CPU, value+backward of mean reverse KL, median of {args.reps}; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"{'contender':<18} {'loss':>12} {'peak MiB':>9} {'median s':>9}")
    for name in args.contenders:
        proc = subprocess.run([sys.executable, __file__, "--worker", name, "--n", str(args.n), "--d", str(args.d),
                               "--reps", str(args.reps)], capture_output=True, text=True)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{name:<18} FAILED: {reason}", flush=True)
            continue
        loss, peak, median = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name:<18} {loss:>12.6f} {peak:>9.0f} {median:>9.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
