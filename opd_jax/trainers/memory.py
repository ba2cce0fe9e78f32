"""An analytic per-device memory estimate of a training step, checked before anything is
compiled: a seq_len or batch whose step cannot fit is refused with the estimate (it used to
compile for 30 s and die with a raw 15 TB allocation); one within 20% of the memory warns.

    est = step_memory(cfg, model_config, n_batch_devices=8)
    est.total, est.parts          # bytes per device; {"params": ..., "activations": ...}
    check_memory(cfg, model_config, mesh)   # raises / warns against the device's memory

What it counts, for one optimizer step's micro-batch per device (SFT: ``batch_size /
grad_accum / batch devices`` rows of ``data.seq_len``; GRPO/OPD: ``prompts_per_step x
group_size / minibatches / batch devices`` rows of ``rollout.seq_len``). A policy run with
``rollout.seq_len=0`` buckets each batch to its longest episode, a length known only once
sampled (``max_new_tokens x max_turns`` bounds it but real episodes stop far earlier: the
main job's 2240-token bound would refuse a run whose steps use 100-token rows), so it is
not estimated here:

* params, gradients (param dtype) and AdamW's two moments (fp32; SGD none), unsharded: a
  bound for FSDP meshes;
* activations saved for the backward, per token: each layer's inputs of its matmuls,
  norms and residuals (~10 x hidden + 3 x intermediate values) and the plain attention's
  scores and probabilities (2 x heads x T), in the compute dtype; with ``model.remat``
  one hidden-size input per layer plus one layer live again;
* the logits, their log-softmax and its gradient, fp32 (3 x vocab per token).

`studies/scale_estimate.py` traces the real residuals for the scale-up presets; this is its
cheap analytic form for the trainers' start (no tracing): within ~2x of XLA:CPU's compiled
temp memory for the tiny presets, which is what an up-front refusal needs.
The device's memory: its ``bytes_limit`` (GPU/TPU); on CPU the host's memory
(/proc/meminfo MemTotal, or sysconf) shared by the fake devices.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import ml_collections

from opd_jax.checkpoint.storage import format_bytes
from opd_jax.schema import ConfigError

WARN_FRACTION = 0.8      # an estimate above 80% of the memory (within 20% of it) warns


@dataclasses.dataclass(frozen=True)
class Estimate:
    parts: dict[str, int]
    rows: int
    seq: int
    what: str                 # "data.seq_len=... x ..." for the message

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def step_memory(cfg: ml_collections.ConfigDict, model_config, n_batch_devices: int) -> Estimate:
    """The estimate of one training step's peak bytes per device (module doc)."""
    m = model_config
    if "data" in cfg:
        d = cfg.data
        rows = max(1, d.batch_size // cfg.optim.grad_accum // n_batch_devices)
        seq, what = d.seq_len, f"data.seq_len={d.seq_len} x {rows} rows per device"
    else:
        r = cfg.rollout
        rows = max(1, r.prompts_per_step * r.group_size // cfg.rl.minibatches // n_batch_devices)
        seq, what = r.seq_len, f"rollout.seq_len={r.seq_len} x {rows} rows per device"
    n_params = m.num_params()
    p = n_params * jnp.dtype(m.param_dtype).itemsize
    opt = 2 * n_params * 4 if cfg.optim.name == "adamw" else 0
    act_bytes = jnp.dtype(m.dtype).itemsize
    per_layer = (10 * m.hidden_size + 3 * m.intermediate_size + 2 * m.num_heads * seq) \
        * act_bytes
    if m.remat != "none":
        layers = m.num_layers * m.hidden_size * act_bytes + per_layer
    else:
        layers = m.num_layers * per_layer
    tokens = rows * seq
    return Estimate({"params": p, "gradients": p, "optimizer": opt,
                     "activations": tokens * layers,
                     "logits": tokens * m.vocab_size * 4 * 3}, rows, seq, what)


def device_memory() -> tuple[int, str]:
    """(bytes, what) one device can hold: its bytes_limit (accelerators) or the host's."""
    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{dev.device_kind} memory"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "host memory"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


def check_memory(cfg: ml_collections.ConfigDict, model_config, n_batch_devices: int,
                 memory: tuple[int, str] | None = None) -> Estimate | None:
    """Refuse (ConfigError, naming the estimate and its largest part) a step whose estimate
    exceeds the memory; warn above WARN_FRACTION of it. On CPU the fake devices share the
    host: their estimates add up. A bucketed policy run (``rollout.seq_len=0``) is not
    estimated (None)."""
    if "rollout" in cfg and not cfg.rollout.seq_len:
        return None
    est = step_memory(cfg, model_config, n_batch_devices)
    limit, where = memory or device_memory()
    shared = jax.default_backend() == "cpu"
    need = est.total * (jax.local_device_count() if shared else 1)
    big = max(est.parts, key=est.parts.get)
    text = (f"{est.what}: the training step is estimated at {format_bytes(need)}"
            f"{f' over {jax.local_device_count()} CPU devices' if shared else ' per device'} "
            f"({big} {format_bytes(est.parts[big] * (jax.local_device_count() if shared else 1))})"
            f", {{}} the {format_bytes(limit)} of {where}")
    if need > limit:
        raise ConfigError(text.format("more than") + "; expected a shorter sequence or "
                                 "fewer rows per device (or model.remat='layer')")
    if need > WARN_FRACTION * limit:
        warnings.warn(text.format("within 20% of") + "; the run may run out of memory",
                      RuntimeWarning, stacklevel=3)
    return est
