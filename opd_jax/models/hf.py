"""Hugging Face I/O: config.json <-> ModelConfig, safetensors <-> Transformer, no torch.

    model = load_pretrained("ckpts/Qwen3-1.7B", dtype="bfloat16")           # host -> device
    model = load_pretrained(path, mesh=make_mesh((1, 4, 2)))                 # straight into shards
    save_pretrained(model, "out/")   # AutoModelForCausalLM.from_pretrained("out/") loads it

Layout: our q kernel is [D, H, Dh], HF's q_proj.weight is [H * Dh, D]; every parameter is
`hf.reshape(grouped).transpose(perm)` of one HF tensor (see `_layout`). With a mesh, each
device's block is read from the memory-mapped file, never the whole tensor per device.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax import sharding as sh
from opd_jax.models.builtin import resolve_model_path
from opd_jax.models.config import ModelConfig
from opd_jax.models.gguf_io import gguf_folder, is_gguf
from opd_jax.models.identity import read_json, verify_identity, write_identity
from opd_jax.models.rope import check_rope_scaling
from opd_jax.models.safetensors_io import SafetensorsFolder, write_folder
from opd_jax.models.transformer import Transformer

HF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_SUPPORTED = ", ".join(f"{v} (model_type {k!r})" for k, v in HF_ARCHS.items())


def config_from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (transformers 5.x keys, old keys too)."""
    arch = hf.get("model_type")
    if arch not in HF_ARCHS:
        archs = hf.get("architectures")
        arch = next((k for k, v in HF_ARCHS.items() if archs and v in archs), None)
    if arch is None:
        raise ValueError(f"unsupported architecture in config.json: model_type="
                         f"{hf.get('model_type')!r}, architectures={hf.get('architectures')}; "
                         f"supported: {_SUPPORTED}")
    rope = _rope_from_hf(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=true in config.json is not supported; expected false")
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true in config.json is not supported; "
                         "expected false")
    heads = hf["num_attention_heads"]
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    fields = dict(
        arch=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10_000.0),
        rope_scaling=check_rope_scaling(rope) if rope else None,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        dtype=dtype, param_dtype=dtype)
    return ModelConfig(**{**fields, **overrides})


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope dict of config.json (rope_theta included): `rope_parameters` (transformers
    5) or `rope_scaling` (older), "type" read as "rope_type"; both present must agree."""
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"config.json {key}={value!r}: expected a dict or null")
        value = dict(value)
        if "type" in value:
            kind = value.pop("type")
            if value.setdefault("rope_type", kind) != kind:
                raise ValueError(f"config.json {key} has type={kind!r} and rope_type="
                                 f"{value['rope_type']!r}; expected one of them or equal")
        if value.get("rope_theta") is None:
            value.pop("rope_theta", None)
        found[key] = value
    if len(found) == 2:
        a, b = found["rope_parameters"], found["rope_scaling"]
        clash = {k: (a[k], b[k]) for k in set(a) & set(b) if a[k] != b[k]}
        if clash:
            raise ValueError(f"config.json rope_parameters and rope_scaling disagree on "
                             f"{sorted(clash)}: (rope_parameters, rope_scaling) values {clash}")
    rope = {**found.get("rope_scaling", {}), **found.get("rope_parameters", {})}
    if rope and "rope_type" not in rope:
        rope["rope_type"] = "default"
    theta = rope.get("rope_theta")
    if theta is not None and hf.get("rope_theta") is not None and theta != hf["rope_theta"]:
        raise ValueError(f"config.json rope_theta={hf['rope_theta']!r} disagrees with the "
                         f"rope dict's rope_theta={theta!r}")
    return rope


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """HF config.json dict that transformers' Auto classes read back to the same model."""
    if cfg.use_qk_norm != (cfg.arch == "qwen3"):
        raise ValueError(f"qk_norm={cfg.use_qk_norm} cannot be expressed for HF arch "
                         f"{cfg.arch!r} (only qwen3 has q/k norms)")
    if cfg.arch == "qwen2" and not cfg.use_qkv_bias:
        raise ValueError("qkv_bias=False cannot be expressed for HF arch 'qwen2'")
    hf = dict(
        architectures=[HF_ARCHS[cfg.arch]], model_type=cfg.arch, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={**(cfg.rope or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        dtype=cfg.param_dtype, torch_dtype=cfg.param_dtype, use_cache=True,
        initializer_range=0.02)
    if cfg.arch != "qwen2":
        hf["attention_bias"] = cfg.use_qkv_bias
    else:
        hf["use_sliding_window"] = False
    if cfg.arch == "qwen3":
        hf["use_sliding_window"] = False
    return hf


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Our param = hf_tensor.reshape(grouped).transpose(perm); groups[j] lists the grouped
    dims that HF dim j was split into."""
    name: str
    grouped: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.grouped[d] for d in g) for g in self.groups)


def _layout(path: tuple, cfg: ModelConfig) -> _Layout:
    D, F, H, K, Dh, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    mat_t = lambda name, rows, cols: _Layout(name, (rows, cols), ((0,), (1,)), (1, 0))  # noqa
    if path == ("embed",):
        return _Layout("model.embed_tokens.weight", (V, D), ((0,), (1,)), (0, 1))
    if path == ("lm_head",):
        return mat_t("lm_head.weight", V, D)
    if path == ("final_norm", "scale"):
        return _Layout("model.norm.weight", (D,), ((0,),), (0,))
    _, i, *rest = path
    p = f"model.layers.{i}."
    rest = tuple(rest)
    heads = {"q": H, "k": K, "v": K}
    table = {
        ("attn_norm", "scale"): _Layout(p + "input_layernorm.weight", (D,), ((0,),), (0,)),
        ("mlp_norm", "scale"): _Layout(p + "post_attention_layernorm.weight", (D,), ((0,),), (0,)),
        ("attn", "q_norm", "scale"): _Layout(p + "self_attn.q_norm.weight", (Dh,), ((0,),), (0,)),
        ("attn", "k_norm", "scale"): _Layout(p + "self_attn.k_norm.weight", (Dh,), ((0,),), (0,)),
        ("attn", "o"): _Layout(p + "self_attn.o_proj.weight", (D, H, Dh), ((0,), (1, 2)),
                               (1, 2, 0)),
        ("mlp", "gate"): mat_t(p + "mlp.gate_proj.weight", F, D),
        ("mlp", "up"): mat_t(p + "mlp.up_proj.weight", F, D),
        ("mlp", "down"): mat_t(p + "mlp.down_proj.weight", D, F),
    }
    for x, n in heads.items():
        table[("attn", x)] = _Layout(p + f"self_attn.{x}_proj.weight", (n, Dh, D),
                                     ((0, 1), (2,)), (2, 0, 1))
        table[("attn", x + "_bias")] = _Layout(p + f"self_attn.{x}_proj.bias", (n, Dh),
                                               ((0, 1),), (0, 1))
    if rest not in table:
        raise KeyError(f"no Hugging Face name for parameter {'/'.join(map(str, path))}")
    return table[rest]


def _read_block(tensor: np.ndarray, lay: _Layout, index: tuple) -> np.ndarray:
    """Our-layout block `index` (tuple of slices) read from the HF-layout `tensor`."""
    ours = [range(*s.indices(lay.grouped[lay.perm[j]])) for j, s in enumerate(index)]
    grouped = [None] * len(lay.perm)
    for j, p in enumerate(lay.perm):
        grouped[p] = ours[j]
    hf_index, shape, inner = [], [], []
    for g in lay.groups:
        rest = math.prod(lay.grouped[d] for d in g[1:])
        first = grouped[g[0]]  # leading grouped dim -> contiguous rows of the HF dim
        hf_index.append(slice(first.start * rest, first.stop * rest))
        shape += [len(first)] + [lay.grouped[d] for d in g[1:]]
        inner += [slice(None)] + [slice(grouped[d].start, grouped[d].stop) for d in g[1:]]
    block = np.asarray(tensor[tuple(hf_index)]).reshape(shape)[tuple(inner)]
    return np.transpose(block, lay.perm)


def _abstract_model(cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def read_config(path) -> ModelConfig:
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json in {os.fspath(path)}")
    hf = read_json(file, "a Hugging Face config.json")
    try:
        return config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{file}: {what}; expected a Hugging Face config.json of a "
                         f"supported model") from None


def load_pretrained(path, *, dtype=None, param_dtype=None, mesh=None, rules=None,
                    remat=None) -> Transformer:
    """Transformer from an HF folder (config.json + model.safetensors[.index.json]), a
    ``builtin:`` name or a GGUF file (`models.gguf_io`: dequantized to fp32, converted once into a cache folder).

    param_dtype defaults to the checkpoint's dtype, dtype (compute) to param_dtype; remat
    (ModelConfig.remat, not an HF field) to "none". With a
    mesh, params are created in their NamedShardings (opd_jax.sharding rules) from
    per-device blocks of the memory-mapped files.
    """
    path = resolve_model_path(os.fspath(path))   # builtin:NAME -> its folder or file
    if is_gguf(path):         # a GGUF file: its HF folder, converted once into the cache
        path = gguf_folder(path)
    verify_identity(path)   # the bytes recorded when it was written (exports, the base)
    cfg = read_config(path)
    pd = cfg.param_dtype if param_dtype is None else jnp.dtype(param_dtype).name
    cfg = cfg.replace(param_dtype=pd, dtype=pd if dtype is None else jnp.dtype(dtype).name,
                      remat=cfg.remat if remat is None else remat)
    ckpt = SafetensorsFolder(path)
    ckpt.check_finite()     # NaN/inf bytes fail here, naming the tensor (or skip: env)
    graphdef, abs_state = _abstract_model(cfg)
    flat = list(nnx.to_flat_state(abs_state))
    layouts = [_layout(p, cfg) for p, _ in flat]
    for lay in layouts:  # validate everything before reading anything
        if lay.name not in ckpt:
            raise ValueError(f"tensor {lay.name!r} missing from the safetensors in {path} "
                             f"(expected by its config.json, arch {cfg.arch})")
        if tuple(ckpt[lay.name].shape) != lay.hf_shape:
            raise ValueError(f"tensor {lay.name!r} in {path} has shape "
                             f"{tuple(ckpt[lay.name].shape)}, expected {lay.hf_shape}")
    rules = sh.DEFAULT_RULES if rules is None else rules
    for (p, var), lay in zip(flat, layouts):
        shape, tensor = var.get_value().shape, ckpt[lay.name]
        if mesh is None:
            full = tuple(slice(None) for _ in shape)
            value = jnp.asarray(_read_block(tensor, lay, full).astype(pd))
        else:
            names = var.get_metadata().get("out_sharding")
            value = jax.make_array_from_callback(
                shape, sh.named_sharding(names, shape, mesh, rules),
                lambda idx, t=tensor, lay=lay: _read_block(t, lay, idx).astype(pd))
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(model: Transformer, path, *, max_shard_bytes: int | None = None,
                    tokenizer: dict | None = None) -> None:
    """Write config.json + safetensors (sharded with an index past max_shard_bytes) and
    identity.json: their sha256 and `tokenizer` (``{"spec", "fingerprint"}``, the
    tokenizer the model was trained with; `models.identity`).

    Tensors keep the param dtype. Refuses a folder that already holds a model.
    """
    path = os.fspath(path)
    cfg: ModelConfig = model.config
    hf_config = config_to_hf(cfg)  # fails before anything is written
    if any(os.path.exists(os.path.join(path, f)) for f in
           ("config.json", "model.safetensors", "model.safetensors.index.json")):
        raise FileExistsError(f"{path} already holds a model; expected an empty or new folder")
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        lay = _layout(p, cfg)
        ours = np.asarray(jax.device_get(var.get_value()))
        hf = np.transpose(ours, np.argsort(lay.perm)).reshape(lay.hf_shape)
        tensors[lay.name] = np.ascontiguousarray(hf)
    os.makedirs(path, exist_ok=True)
    order = sorted(tensors, key=_natural_key)
    write_folder(path, {k: tensors[k] for k in order}, max_shard_bytes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_identity(path, tokenizer)


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in name.split(".")]
