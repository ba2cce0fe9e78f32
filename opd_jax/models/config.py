"""ModelConfig: the shape and numerics of a decoder-only Llama / Qwen2 / Qwen3 transformer.

One frozen dataclass, JSON-safe (`to_dict` / `from_dict`), with named presets::

    cfg = ModelConfig.preset("tiny", vocab_size=300)
    cfg = ModelConfig.preset("qwen3-8b", dtype="bfloat16")   # full shapes, for eval_shape
    cfg = ModelConfig.preset("qwen3-1.7b", remat="layer")    # gradient checkpointing
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from opd_jax.models.rope import check_rope_scaling

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
# Rematerialisation (gradient checkpointing) of each decoder layer in the backward pass:
#   "none":  autodiff keeps every layer's residuals (its [H, T, T] attention included);
#   "layer": only each layer's input is kept, its forward is recomputed in the backward;
#   "dots":  as "layer", but the layer's weight matmuls without batch dimensions (q/k/v/o
#            projections, MLP) are kept too; the attention's [T, T] products are recomputed.
REMATS = ("none", "layer", "dots")
# Fields that change how the model is run, not its parameters or its outputs: a checkpoint
# written under one value loads and resumes under another (see `architecture`).
EXECUTION_FIELDS = ("remat",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters.

    `qkv_bias` / `qk_norm` default by family (qwen2 has q/k/v biases, qwen3 has RMSNorm on
    per-head q and k); `dtype` is the compute dtype and `param_dtype` the storage dtype
    (bf16 compute with fp32 params is the usual training setting).

    `remat` (one of REMATS) is a training knob, not an architecture field: it trades the
    backward pass's memory for recomputation ("layer" keeps one [B, T, D] input per layer
    instead of every activation, ~1/3 more compute) and leaves every value, gradient and
    parameter unchanged; the KV-cache decode path and forward-only calls ignore it. Hugging
    Face config.json neither holds nor sets it (loaded configs get "none" unless the caller
    overrides it); opd_jax checkpoints record it in their metadata, and resuming or
    starting from one under another value is allowed (`trainers.workdir.check_workdir` compares
    everything but EXECUTION_FIELDS).
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    arch: str = "qwen3"
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    # RoPE scaling (see opd_jax/models/rope.py): None for plain RoPE, else a dict with a
    # "rope_type" and its fields; held as sorted (key, value) pairs so the config hashes.
    rope_scaling: Any = None

    def __post_init__(self):
        rope = self.rope_scaling
        if isinstance(rope, (tuple, list)):
            rope = dict(rope)
        rope = check_rope_scaling(rope)
        object.__setattr__(self, "rope_scaling",
                           None if rope is None else tuple(sorted(rope.items())))
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} is not supported; expected one of {ARCHS}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: expected an even size (RoPE pairs)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {DTYPES}")
        if self.remat not in REMATS:
            raise ValueError(f"remat={self.remat!r}: expected one of {REMATS}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(f"rope_theta={self.rope_theta}, rms_norm_eps={self.rms_norm_eps}: "
                             f"expected positive numbers")

    # Resolved family defaults.
    @property
    def rope(self) -> dict[str, Any] | None:
        """The rope scaling as a dict (None for plain RoPE)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def use_qkv_bias(self) -> bool:
        return self.arch == "qwen2" if self.qkv_bias is None else bool(self.qkv_bias)

    @property
    def use_qk_norm(self) -> bool:
        return self.arch == "qwen3" if self.qk_norm is None else bool(self.qk_norm)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, h, kv, dh = (self.hidden_size, self.intermediate_size, self.num_heads,
                           self.num_kv_heads, self.head_dim)
        attn = d * h * dh * 2 + d * kv * dh * 2
        attn += (h + 2 * kv) * dh if self.use_qkv_bias else 0
        attn += 2 * dh if self.use_qk_norm else 0
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embed + d

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "rope_scaling": self.rope}

    def architecture(self) -> dict[str, Any]:
        """`to_dict` without dtype, param_dtype and EXECUTION_FIELDS: the fields two models
        must share to hold the same parameters (merging, init_from checks)."""
        drop = ("dtype", "param_dtype", *EXECUTION_FIELDS)
        return {k: v for k, v in self.to_dict().items() if k not in drop}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named shape. "tiny" is ~1.5M params (vocab 128 unless overridden)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


_QWEN3 = dict(arch="qwen3", vocab_size=151936, head_dim=128, num_kv_heads=8,
              rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)

# Shapes from the published Qwen3 config.json files.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(arch="qwen3", vocab_size=128, hidden_size=128, intermediate_size=512,
                 num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32,
                 rope_theta=10_000.0, max_position_embeddings=2048),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, tie_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_layers=28,
                       num_heads=16, tie_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_layers=36,
                     num_heads=32, tie_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, tie_embeddings=False),
    # The published Llama-3.2-1B config.json (rope_type llama3, 8192-token original window).
    "llama3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048,
                        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                        head_dim=64, rope_theta=500_000.0, rms_norm_eps=1e-5,
                        tie_embeddings=True, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
}
