"""Decoder-only transformer (Llama / Qwen2 / Qwen3 families) in Flax NNX, with a KV cache.

Letters: B batch, T new tokens, S key slots (T without cache, cache length with one),
D hidden, H query heads, K kv heads, G = H / K, Dh head dim, F mlp, V vocab, L layers.

    model = Transformer(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    logits_BxTxV = model(tokens_BxT)
    hidden_BxTxD = model(tokens_BxT, return_hidden=True)     # model.logits(hidden) == logits
    cache = model.init_cache(batch=B, max_len=64)
    logits_BxTxV, cache = model(prompt_BxT, positions_BxT=pos_BxT, cache=cache,
                                attention_mask_BxT=mask_BxT)

Numerics: matmuls run in `config.dtype`; RMSNorm statistics, RoPE angles, attention scores
and softmax in fp32 (bf16 loses the softmax tail).

Memory: `config.remat` ("none" | "layer" | "dots", see ModelConfig) wraps each layer of the
no-cache call in `nnx.remat` (jax.checkpoint), so a backward pass keeps each layer's input
instead of all its activations (the [B, H, T, T] attention scores and probabilities are
the big ones) and recomputes one layer at a time. Values and gradients are unchanged; a
forward without autodiff and the cached (decode) call run the layers directly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax import lax

from opd_jax import sharding as sh
from opd_jax.models import rope as rope_lib
from opd_jax.models.config import ModelConfig

F32 = jnp.float32
_MASKED = -1e30  # finite: a fully masked row (padding) gives a uniform average, not NaN
_init = jax.nn.initializers.normal(0.02)  # HF initializer_range default


def _param(value, names) -> nnx.Param:
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


@struct.dataclass
class KVCache:
    """Keys/values of every layer in fixed slots, plus which slots may be attended.

    k: one [B, K, Dh, S] array per layer, v: one [B, K, S, Dh] (tuples of L; kv heads
    before slots, each layer's buffer updated in place: no per-step slice or transpose
    copies). Keys are stored transposed, slots last: a decode step's scores are then a
    [G, Dh] x [Dh, S] product per (row, kv head) reading S-contiguous rows: on XLA:CPU a
    `generate` decode step of SmolLM2-135M at B=64 over 256 slots took 190-212 ms against
    293-313 ms with [S, Dh] keys (2 cores, alternating runs); values keep [S, Dh], the
    layout their product reads;
    valid: [B, S] bool; index: int32 scalar, the next free slot
    (shared by all rows). A call with T tokens writes slots [index, index + T), sets
    valid there from its attention mask, and advances index by T. A query in slot j
    attends to the slots s <= j where valid[b, s]. Slots are not positions: RoPE
    positions come from the caller (a left-padded row starts at position 0 on its first
    real token).

    Precondition: ``0 <= index`` and ``index + T <= max_len`` (XLA's dynamic_update_slice
    would otherwise clamp the write onto earlier slots, silently). It is checked
    (ValueError naming index, T and the length) whenever index is concrete: an eager
    call, or a Python int. Under jit the index is traced and not checked (a device-side
    check would cost every decode step): jitted callers keep room themselves, as the
    rollout engine does (`generate` and `play` refuse prompts that do not fit
    before any work; `decode` stops at ``index + 1 < max_len``), and an overflow left
    ``index > max_len`` in the returned cache, so ``int(cache.index) <= cache.max_len``
    checks a jitted call afterwards.
    """
    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array

    KEY_AXES = ("batch", "kv_heads", "head_dim", "seq")         # of each layer's k
    VALUE_AXES = ("batch", "kv_heads", "seq", "head_dim")       # of each layer's v

    @classmethod
    def create(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
        return _zero_cache(config.num_layers, batch, config.num_kv_heads, config.head_dim,
                           max_len, dtype)

    @property
    def valid_BxS(self) -> jax.Array:
        return self.valid

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def shardings(self, mesh, rules=None) -> "KVCache":
        """NamedShardings for this cache on `mesh` (batch and kv heads split, slots whole)."""
        rules = sh.DEFAULT_RULES if rules is None else rules
        k = sh.named_sharding(self.KEY_AXES, self.k[0].shape, mesh, rules)
        v = sh.named_sharding(self.VALUE_AXES, self.v[0].shape, mesh, rules)
        return KVCache(k=(k,) * len(self.k), v=(v,) * len(self.v),
                       valid=sh.named_sharding(("batch", "seq"), self.valid.shape, mesh, rules),
                       index=sh.replicated(mesh))


@functools.partial(jax.jit, static_argnums=range(6))
def _zero_cache(L: int, B: int, K: int, Dh: int, S: int, dtype) -> KVCache:
    """An empty cache as one program (eager jnp.zeros would compile one per shape)."""
    return KVCache(k=tuple(jnp.zeros((B, K, Dh, S), dtype) for _ in range(L)),
                   v=tuple(jnp.zeros((B, K, S, Dh), dtype) for _ in range(L)),
                   valid=jnp.zeros((B, S), bool), index=jnp.zeros((), jnp.int32))


def check_cache_room(index, T: int, max_len: int) -> None:
    """ValueError unless slots [index, index + T) lie in a cache of `max_len` slots, when
    `index` is concrete (a Python int or a concrete array); a traced index is the
    caller's to keep in range (see KVCache)."""
    if isinstance(index, jax.core.Tracer):
        return
    i = int(index)
    if i < 0 or i + T > max_len:
        raise ValueError(f"KV cache overflow: writing T={T} tokens at index={i} needs slots "
                         f"[{i}, {i + T}) but the cache length is {max_len} slots "
                         f"(index + T <= {max_len} required); create a longer cache "
                         f"(init_cache(batch, max_len)) or write fewer tokens")


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, statistics in fp32."""

    def __init__(self, size: int, eps: float, param_dtype):
        self.scale = _param(jnp.ones((size,), param_dtype), ("norm",))
        self.eps = eps

    def __call__(self, x, dtype):
        x32 = x.astype(F32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(F32)).astype(dtype)


def rope_cos_sin(positions_BxT, head_dim: int, theta: float, rope=None,
                 max_position_embeddings: int = 0):
    """HF "rotate_half" RoPE tables: angle[b, t, i] = pos * inv_freq[i], i < Dh / 2,
    repeated twice along the last axis (inv_freq[i] = theta^(-2i / Dh) for plain RoPE, the
    scaled frequencies of `rope`, a ModelConfig.rope dict, otherwise; yarn also scales cos
    and sin by its attention factor). Returns fp32 cos, sin of shape [B, T, Dh]."""
    inv_freq = rope_lib.inv_freq(rope, head_dim, theta, max_position_embeddings, positions_BxT)
    angle_BxTxDh2 = positions_BxT.astype(F32)[..., None] * inv_freq
    angle_BxTxDh = jnp.concatenate([angle_BxTxDh2, angle_BxTxDh2], axis=-1)
    scale = rope_lib.attention_factor(rope)
    return jnp.cos(angle_BxTxDh) * scale, jnp.sin(angle_BxTxDh) * scale


def apply_rope(x_BxTxNxDh, cos_BxTxDh, sin_BxTxDh):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (HF Llama layout)."""
    x1, x2 = jnp.split(x_BxTxNxDh, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BxTxDh[:, :, None, :], sin_BxTxDh[:, :, None, :]
    return (x_BxTxNxDh.astype(F32) * cos + rotated.astype(F32) * sin).astype(x_BxTxNxDh.dtype)


def attend(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS, dtype):
    """Grouped-query softmax(q k^T / sqrt(Dh) + mask) v; query head h reads kv head h // G.

    Keys and values come head-major in the KV cache's layouts (keys [B, K, Dh, S], values
    [B, K, S, Dh]), so both products are batched over (b, k) with no transpose of the
    cached keys or values."""
    B, T, H, Dh = q_BxTxHxDh.shape
    K = k_BxKxDhxS.shape[1]
    q_BxKxGxTxDh = q_BxTxHxDh.reshape(B, T, K, H // K, Dh).transpose(0, 2, 3, 1, 4)
    s_BxKxGxTxS = jnp.einsum("bkgtd,bkds->bkgts", q_BxKxGxTxDh, k_BxKxDhxS.astype(dtype),
                             preferred_element_type=F32) * (Dh ** -0.5)
    s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, _MASKED)
    p_BxKxGxTxS = jax.nn.softmax(s_BxKxGxTxS, axis=-1)
    o_BxKxGxTxDh = jnp.einsum("bkgts,bksd->bkgtd", p_BxKxGxTxS.astype(dtype),
                              v_BxKxSxDh.astype(dtype), preferred_element_type=F32)
    return o_BxKxGxTxDh.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(dtype)


# A cached call attends over a prefix of the cache's slots: the smallest of up to
# DECODE_VIEWS static views (S/n, 2S/n, ..., S, rounded up) holding every slot written so
# far, picked by lax.switch. The slots past the write index are masked anyway, so the
# values are the full-S attention's; the work follows the live length, not the cache's.
# Decode steps only (T = 1). On XLA:CPU (SmolLM2-135M, 32-token prompts, 128 new tokens,
# 256 slots, whole generate calls with prefill, 2 alternating runs each) B=64 ran at
# 318-325 tok/s against 296-298 over all slots, B=16 207-218 against 188-202, B=1 34-37
# against 34-36; the first call's compile took 1-4 s longer. CPU only: XLA:GPU runs a
# conditional by copying its branch index to the host, a sync per layer and step.
# Views are at least MIN_VIEW slots (a small cache gets fewer, or none: each view is one
# more branch to compile per layer, and a few saved slots are not worth it). MIN_VIEW 64
# rather than 32 halves the views of a 256-slot cache: the 19M benchmark's first generate
# compiled about 0.6 s less (decode 1.56 s against 2.32 s of trace + compile), and
# SmolLM2-135M at T=1, 128 new tokens, ran 594-598 tok/s at B=64 against 607-619 with 8
# views and the same within noise at B=16 (401-440 against 426-430; 2 CPU cores, Dec 7).
DECODE_VIEWS, MIN_VIEW = 8, 64


def cache_views(S: int) -> tuple[int, ...]:
    """The static slot counts a cached call may attend over (see DECODE_VIEWS): S/n,
    2S/n, ..., S rounded up, n = min(DECODE_VIEWS, S // MIN_VIEW); (S,) alone off CPU."""
    n = min(DECODE_VIEWS, S // MIN_VIEW)
    if jax.default_backend() != "cpu" or n <= 1:
        return (S,)
    return tuple(sorted({-(-S * i // n) for i in range(1, n + 1)}))


def attend_cached(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS, index, dtype):
    """`attend` for queries in slots [index, index + T) of a cache: a decode step (T = 1)
    over the smallest `cache_views` prefix holding slots [0, index + T) (equal values,
    less work); longer appends over all slots (their switch would add compile time for
    little: their work is the projections)."""
    T, S = q_BxTxHxDh.shape[1], v_BxKxSxDh.shape[2]
    views = cache_views(S)
    if len(views) == 1 or T > 1:    # appends (prefill): GEMM-bound, one program
        return attend(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS, dtype)
    branch = jnp.sum(jnp.asarray(views[:-1], jnp.int32) < index + T)

    def view(n):
        return lambda q, k, v, m: attend(q, k[..., :n], v[:, :, :n], m[..., :n], dtype)
    return lax.switch(branch, [view(n) for n in views], q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh,
                      mask_BxTxS)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, K, Dh, pd = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.params_dtype)
        self.q = _param(_init(rngs.params(), (D, H, Dh), pd), ("embed", "heads", "head_dim"))
        self.k = _param(_init(rngs.params(), (D, K, Dh), pd), ("embed", "kv_heads", "head_dim"))
        self.v = _param(_init(rngs.params(), (D, K, Dh), pd), ("embed", "kv_heads", "head_dim"))
        self.o = _param(_init(rngs.params(), (H, Dh, D), pd), ("heads", "head_dim", "embed"))
        if cfg.use_qkv_bias:
            self.q_bias = _param(jnp.zeros((H, Dh), pd), ("heads", "head_dim"))
            self.k_bias = _param(jnp.zeros((K, Dh), pd), ("kv_heads", "head_dim"))
            self.v_bias = _param(jnp.zeros((K, Dh), pd), ("kv_heads", "head_dim"))
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, pd)
        self.cfg = cfg

    def _project(self, x_BxTxD, name: str, dtype):
        w = getattr(self, name)[...].astype(dtype)
        y = jnp.einsum("btd,dnh->btnh", x_BxTxD, w, preferred_element_type=F32)
        if self.cfg.use_qkv_bias:
            y = y + getattr(self, name + "_bias")[...].astype(F32)
        return y.astype(dtype)

    def __call__(self, x_BxTxD, cos_BxTxDh, sin_BxTxDh, mask_BxTxS, kv=None):
        """kv = (k_BxKxDhxS, v_BxKxSxDh, index) of this layer for cached calls, else None;
        returns (out, the layer's updated (k, v) or None)."""
        dtype = self.cfg.compute_dtype
        q_BxTxHxDh = self._project(x_BxTxD, "q", dtype)
        k_BxTxKxDh = self._project(x_BxTxD, "k", dtype)
        v_BxTxKxDh = self._project(x_BxTxD, "v", dtype)
        if self.cfg.use_qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q_BxTxHxDh = self.q_norm(q_BxTxHxDh, dtype)
            k_BxTxKxDh = self.k_norm(k_BxTxKxDh, dtype)
        q_BxTxHxDh = apply_rope(q_BxTxHxDh, cos_BxTxDh, sin_BxTxDh)
        k_BxTxKxDh = apply_rope(k_BxTxKxDh, cos_BxTxDh, sin_BxTxDh)
        k_BxKxDhxT = k_BxTxKxDh.transpose(0, 2, 3, 1)
        v_BxKxTxDh = v_BxTxKxDh.transpose(0, 2, 1, 3)
        if kv is None:
            k_BxKxDhxS, v_BxKxSxDh = k_BxKxDhxT, v_BxKxTxDh
        else:
            k_BxKxDhxS, v_BxKxSxDh, index = kv      # this layer's cache
            check_cache_room(index, v_BxKxTxDh.shape[2], v_BxKxSxDh.shape[2])
            zero, index = jnp.zeros((), jnp.int32), jnp.asarray(index, jnp.int32)
            k_BxKxDhxS = lax.dynamic_update_slice(
                k_BxKxDhxS, k_BxKxDhxT.astype(k_BxKxDhxS.dtype), (zero, zero, zero, index))
            v_BxKxSxDh = lax.dynamic_update_slice(
                v_BxKxSxDh, v_BxKxTxDh.astype(v_BxKxSxDh.dtype), (zero, zero, index, zero))
            kv = (k_BxKxDhxS, v_BxKxSxDh)
        if kv is None:
            o_BxTxHxDh = attend(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS, dtype)
        else:
            o_BxTxHxDh = attend_cached(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS,
                                       index, dtype)
        out_BxTxD = jnp.einsum("bthk,hkd->btd", o_BxTxHxDh, self.o[...].astype(dtype),
                               preferred_element_type=F32).astype(dtype)
        return out_BxTxD, kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(x gate) * (x up))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, Fs, pd = cfg.hidden_size, cfg.intermediate_size, cfg.params_dtype
        self.gate = _param(_init(rngs.params(), (D, Fs), pd), ("embed", "mlp"))
        self.up = _param(_init(rngs.params(), (D, Fs), pd), ("embed", "mlp"))
        self.down = _param(_init(rngs.params(), (Fs, D), pd), ("mlp", "embed"))

    def __call__(self, x_BxTxD, dtype):
        g_BxTxF = jnp.dot(x_BxTxD, self.gate[...].astype(dtype), preferred_element_type=F32)
        u_BxTxF = jnp.dot(x_BxTxD, self.up[...].astype(dtype), preferred_element_type=F32)
        h_BxTxF = (jax.nn.silu(g_BxTxF) * u_BxTxF).astype(dtype)
        return jnp.dot(h_BxTxF, self.down[...].astype(dtype),
                       preferred_element_type=F32).astype(dtype)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype)
        self.mlp = MLP(cfg, rngs=rngs)
        self.dtype = cfg.compute_dtype

    def __call__(self, x_BxTxD, cos, sin, mask_BxTxS, kv=None):
        h_BxTxD, kv = self.attn(self.attn_norm(x_BxTxD, self.dtype), cos, sin, mask_BxTxS, kv)
        x_BxTxD = x_BxTxD + h_BxTxD
        x_BxTxD = x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD, self.dtype), self.dtype)
        return x_BxTxD, kv


def _call_block(layer: Block, x_BxTxD, cos, sin, mask_BxTxS):
    return layer(x_BxTxD, cos, sin, mask_BxTxS)[0]


def remat_policy(remat: str):
    """The jax.checkpoint policy of a ModelConfig.remat value ("layer": save nothing)."""
    policies = {"layer": None,
                "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
    if remat not in policies:
        raise ValueError(f"remat={remat!r} has no checkpoint policy; expected one of "
                         f"{sorted(policies)}")
    return policies[remat]


def _check_bt(name: str, x, shape) -> None:
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                         f"(the shape of tokens_BxT)")


def default_positions(B: int, T: int, segment_ids_BxT=None, attention_mask_BxT=None):
    """Positions when the caller gives none (no-cache path).

    With segment_ids: restart at 0 where the id changes (packed documents; padding id 0
    gets positions too, harmless since it is masked). Else with an attention mask:
    cumsum(mask) - 1 clipped at 0, so a left-padded row starts at 0 on its first real
    token. Else arange(T).  E.g. segments [1 1 2 2 2 0] -> [0 1 0 1 2 0].
    """
    t_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if segment_ids_BxT is not None:
        prev_BxT = jnp.pad(segment_ids_BxT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        start_BxT = lax.cummax(jnp.where(segment_ids_BxT != prev_BxT, t_BxT, 0), axis=1)
        return t_BxT - start_BxT
    if attention_mask_BxT is not None:
        return jnp.maximum(jnp.cumsum(attention_mask_BxT.astype(jnp.int32), axis=1) - 1, 0)
    return t_BxT


class Transformer(nnx.Module):
    """Decoder-only LM. See the module docstring for the call forms."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed = _param(_init(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                  cfg.params_dtype), ("vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.params_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(_init(rngs.params(), (cfg.hidden_size, cfg.vocab_size),
                                        cfg.params_dtype), ("embed", "vocab"))

    def unembedding(self) -> jax.Array:
        """W_DxV in param dtype: embed.T when tied, else the lm_head kernel."""
        return self.embed[...].T if self.config.tie_embeddings else self.lm_head[...]

    def logits(self, hidden_BxTxD) -> jax.Array:
        """logits_BxTxV = hidden @ unembedding(), in the compute dtype (fp32 accumulation)."""
        dtype = self.config.compute_dtype
        return jnp.dot(hidden_BxTxD.astype(dtype), self.unembedding().astype(dtype),
                       preferred_element_type=F32).astype(dtype)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        return KVCache.create(self.config, batch, max_len, dtype)

    def __call__(self, tokens_BxT, *, positions_BxT=None, segment_ids_BxT=None,
                 cache: KVCache | None = None, attention_mask_BxT=None,
                 return_hidden: bool = False):
        """Logits [B, T, V] (or final-norm hidden [B, T, D]); with a cache, (out, new_cache).

        Without cache: causal attention, restricted to equal nonzero segment ids when
        `segment_ids_BxT` is given and to keys with mask 1 when `attention_mask_BxT` is.
        With cache: see KVCache; `positions_BxT` is required, segment ids are not allowed.
        """
        cfg = self.config
        dtype = cfg.compute_dtype
        if tokens_BxT.ndim != 2 or not jnp.issubdtype(tokens_BxT.dtype, jnp.integer):
            raise ValueError(f"tokens must be an int [B, T] array, got {tokens_BxT.dtype} "
                             f"of shape {tuple(tokens_BxT.shape)}")
        B, T = tokens_BxT.shape
        for name, x in (("positions_BxT", positions_BxT), ("segment_ids_BxT", segment_ids_BxT),
                        ("attention_mask_BxT", attention_mask_BxT)):
            _check_bt(name, x, (B, T))

        if cache is None:
            if positions_BxT is None:
                positions_BxT = default_positions(B, T, segment_ids_BxT, attention_mask_BxT)
            mask_BxTxS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
            if segment_ids_BxT is not None:
                seg_q, seg_k = segment_ids_BxT[:, :, None], segment_ids_BxT[:, None, :]
                mask_BxTxS = mask_BxTxS & (seg_q == seg_k) & (seg_k != 0)
            if attention_mask_BxT is not None:
                mask_BxTxS = mask_BxTxS & attention_mask_BxT.astype(bool)[:, None, :]
        else:
            if positions_BxT is None:
                raise ValueError("positions_BxT is required with a cache (per row: a "
                                 "left-padded row starts at 0 on its first real token)")
            if segment_ids_BxT is not None:
                raise ValueError("segment_ids_BxT is not supported with a cache; use "
                                 "attention_mask_BxT and positions_BxT")
            if cache.batch != B or T > cache.max_len:
                raise ValueError(f"cache holds batch {cache.batch} x {cache.max_len} "
                                 f"slots; got tokens of shape {(B, T)}")
            new_valid_BxT = (jnp.ones((B, T), bool) if attention_mask_BxT is None
                             else attention_mask_BxT.astype(bool))
            check_cache_room(cache.index, T, cache.max_len)
            index = jnp.asarray(cache.index, jnp.int32)
            valid_BxS = lax.dynamic_update_slice(cache.valid, new_valid_BxT,
                                                 (jnp.zeros((), jnp.int32), index))
            slot_S = jnp.arange(cache.max_len, dtype=jnp.int32)
            q_slot_T = index + jnp.arange(T, dtype=jnp.int32)
            mask_BxTxS = (slot_S[None, None, :] <= q_slot_T[None, :, None]) & valid_BxS[:, None, :]
            new_k, new_v = list(cache.k), list(cache.v)

        cos, sin = rope_cos_sin(positions_BxT, cfg.head_dim, cfg.rope_theta, cfg.rope,
                                cfg.max_position_embeddings)
        x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dtype)
        block = _call_block
        if cache is None and cfg.remat != "none":
            # Only the layer's inputs are saved for the backward; its forward is recomputed.
            # A layer mutates nothing: no graph updates to propagate (which also lets a model
            # closed over by a plain JAX transform run, e.g. jax.make_jaxpr(lambda: model(x))).
            block = nnx.remat(_call_block, policy=remat_policy(cfg.remat),
                              graph_updates=False)
        for i, layer in enumerate(self.layers):
            if cache is None:
                x_BxTxD = block(layer, x_BxTxD, cos, sin, mask_BxTxS)
            else:
                x_BxTxD, (new_k[i], new_v[i]) = layer(x_BxTxD, cos, sin, mask_BxTxS,
                                                      (cache.k[i], cache.v[i], index))
        hidden_BxTxD = self.final_norm(x_BxTxD, dtype)
        out = hidden_BxTxD if return_hidden else self.logits(hidden_BxTxD)
        if cache is None:
            return out
        return out, KVCache(k=tuple(new_k), v=tuple(new_v), valid=valid_BxS, index=index + T)
