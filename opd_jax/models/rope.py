"""RoPE scaling variants: checking the parameters and computing the rotary frequencies.

A model's rope scaling is a dict (`ModelConfig.rope_scaling`, None for plain RoPE) with a
"rope_type" and that type's fields, the same names as config.json's `rope_scaling` /
`rope_parameters` (without rope_theta, which is `ModelConfig.rope_theta`):

  default  nothing else
  linear   factor: every inverse frequency divided by factor
  dynamic  factor: NTK-aware base change from the sequence length (see `inv_freq`)
  llama3   factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
  yarn     factor, original_max_position_embeddings; optional attention_factor, mscale,
           mscale_all_dim, beta_fast (32), beta_slow (1), truncate (true)

"dynamic" is the one variant whose frequencies depend on the input: in a call whose largest
position is p, the base is computed for seq_len = max(p + 1, max_position_embeddings). The
computation runs inside the traced forward, so one compiled function serves every length;
in KV-cache decode each step's keys are rotated (and cached) with the frequencies of that
step, which is what the step-by-step Hugging Face generate does as well.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

F32 = jnp.float32

_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {"yarn": ("attention_factor", "mscale", "mscale_all_dim", "beta_fast",
                      "beta_slow", "truncate")}
ROPE_TYPES = tuple(_REQUIRED)
_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow")


def check_rope_scaling(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """The normalized rope-scaling dict (None for plain RoPE), or a ValueError naming the
    field, its value and what is expected. Unknown fields are refused, not ignored."""
    if rope is None:
        return None
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling={rope!r}: expected a dict or None")
    rope_type = rope.get("rope_type")
    if rope_type not in _REQUIRED:
        raise ValueError(f"rope_type={rope_type!r} is not supported; expected one of "
                         f"{ROPE_TYPES}")
    required, optional = _REQUIRED[rope_type], _OPTIONAL.get(rope_type, ())
    missing = [k for k in required if rope.get(k) is None]
    if missing:
        raise ValueError(f"rope_type={rope_type!r} needs fields {list(required)}; missing "
                         f"{missing} in {rope!r}")
    unknown = sorted(set(rope) - {"rope_type", *required, *optional})
    if unknown:
        raise ValueError(f"rope_type={rope_type!r}: unknown fields {unknown} "
                         f"(values {[rope[k] for k in unknown]}); expected only "
                         f"{list(required) + list(optional)}")
    out: dict[str, Any] = {"rope_type": rope_type}
    for k in (*required, *optional):
        v = rope.get(k)
        if v is None:
            continue
        if k == "truncate":
            if not isinstance(v, bool):
                raise ValueError(f"rope_scaling truncate={v!r}: expected true or false")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"rope_scaling {k}={v!r}: expected a finite number")
        elif k in _POSITIVE and v <= 0:
            raise ValueError(f"rope_scaling {k}={v!r}: expected a positive number")
        out[k] = int(v) if k == "original_max_position_embeddings" else v
    if rope_type in ("linear", "dynamic", "llama3", "yarn") and out["factor"] < 1:
        raise ValueError(f"rope_scaling factor={out['factor']!r} for rope_type "
                         f"{rope_type!r}: expected >= 1 (a context extension)")
    if rope_type == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor={out['high_freq_factor']!r} must "
                         f"exceed low_freq_factor={out['low_freq_factor']!r} (llama3)")
    return None if rope_type == "default" else out


def attention_factor(rope: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by (1 except for yarn)."""
    if rope is None or rope["rope_type"] != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope["factor"]

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
    return get_mscale(factor)


def inv_freq(rope: dict[str, Any] | None, head_dim: int, theta: float,
             max_position_embeddings: int, positions_BxT=None):
    """fp32 inverse frequencies [head_dim // 2] of a rope scaling (see the module doc);
    "dynamic" reads the largest of positions_BxT."""
    exps = jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(F32) / head_dim
    base = 1.0 / (theta ** exps)
    kind = "default" if rope is None else rope["rope_type"]
    if kind == "default":
        return base
    factor = rope["factor"]
    if kind == "linear":
        return base / factor
    if kind == "dynamic":
        seq = jnp.max(positions_BxT).astype(jnp.int32) + 1
        seq = jnp.maximum(seq, max_position_embeddings).astype(F32)
        new_theta = theta * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        return 1.0 / (new_theta ** exps)
    old = rope["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / base
        scaled = jnp.where(wavelen > old / low, base / factor, base)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return jnp.where(medium, smoothed, scaled)
    # yarn
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (head_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    pos_freqs = theta ** (jnp.arange(0, head_dim, 2).astype(F32) / head_dim)
    extrap, interp = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=F32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp
    return interp * (1 - keep) + extrap * keep
