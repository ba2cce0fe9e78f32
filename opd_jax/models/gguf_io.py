"""GGUF checkpoints (llama.cpp's format): the config and the tokenizer from the file's
metadata, the weights dequantized with numpy, written as a Hugging Face folder.

    cfg = gguf_hf_config("m.gguf")          # an HF config.json dict, no tensor read
    convert_gguf("m.gguf", "out_dir")       # config.json, model.safetensors, tokenizer files
    folder = gguf_folder("m.gguf")          # the same, converted once into a cache folder

`load_pretrained("m.gguf")` and `load_tokenizer("m.gguf")` go through `gguf_folder`, so a
GGUF file is accepted wherever an HF folder is (and `opd-jax convert --from m.gguf --to DIR`
writes one). What is read: architectures llama, qwen2 and qwen3; tensor types F32, F16,
BF16, Q8_0, Q4_0 and Q4_1 (dequantized to fp32 exactly as llama.cpp defines them); any
other architecture or tensor type is refused, naming it, before a tensor is dequantized.
llama.cpp stores a Llama model's q and k projection rows permuted for its rotary layout
(`convert_hf_to_gguf.py`, `LlamaModel.permute`); the import undoes it (`unpermute`).
The `gguf` package (numpy only) reads the file; transformers' GGUF tokenizer conversion
builds the fast tokenizer (vocabulary, merges, special tokens, chat template).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from opd_jax.models.identity import file_sha256, write_identity
from opd_jax.models.safetensors_io import write_folder

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
QK = 32     # elements per block of the 8- and 4-bit types
CONVERTER = 2   # bumped when the conversion's output changes: cached folders are keyed by it

# llama.cpp tensor names -> HF names: blk.<i>.<key>.<weight|bias> -> model.layers.<i>.<value>
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _reader(path):
    import gguf   # lazy: an optional dependency (the `gguf` extra, in the test extra)
    return gguf.GGUFReader(os.fspath(path))


def _types():
    import gguf   # lazy: an optional dependency
    t = gguf.GGMLQuantizationType
    return {t.F32: "F32", t.F16: "F16", t.BF16: "BF16", t.Q8_0: "Q8_0", t.Q4_0: "Q4_0",
            t.Q4_1: "Q4_1"}


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 values [*shape] of a tensor's raw GGUF data of type `kind`.

    Q8_0 blocks: fp16 scale d, 32 int8 q; x = d q. Q4_0: d, 16 bytes of 4-bit q (low
    nibbles are elements 0-15, high nibbles 16-31); x = d (q - 8). Q4_1: d, fp16 min m,
    the same nibbles; x = d q + m."""
    n = int(np.prod(shape))
    if kind == "F32":
        return np.asarray(raw).view(np.float32).reshape(shape).astype(np.float32)
    if kind == "F16":
        return np.asarray(raw).view(np.float16).reshape(shape).astype(np.float32)
    if kind == "BF16":
        bits = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    b = np.asarray(raw, np.uint8).reshape(-1)
    if kind == "Q8_0":
        blocks = b.reshape(n // QK, 2 + QK)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        blocks = b.reshape(n // QK, head + QK // 2)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        nib = blocks[:, head:]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=1).astype(np.float32)
        if kind == "Q4_0":
            return (d * (q - 8.0)).reshape(shape)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (d * q + m).reshape(shape)
    raise ValueError(f"tensor type {kind!r}: expected one of F32, F16, BF16, Q8_0, Q4_0, Q4_1")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Llama q/k row permutation (rows = n_head x head_dim)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_name(name: str) -> str:
    """The HF name of a llama.cpp tensor name (raises on an unknown one)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face name here; expected "
                     f"blk.N.{{{', '.join(sorted(_LAYER))}}} or {sorted(_TOP)}")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _check(reader, path) -> str:
    """The architecture, after checking it and every tensor's type (nothing dequantized)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF {os.fspath(path)!r}: architecture {arch!r} is not supported; "
                         f"expected one of {sorted(ARCHS)}")
    types = _types()
    for t in reader.tensors:
        if t.tensor_type not in types:
            raise ValueError(f"GGUF {os.fspath(path)!r}: tensor {t.name!r} has type "
                             f"{t.tensor_type.name}, which is not supported; expected one of "
                             f"{sorted(types.values())}")
        hf_name(t.name)
    return arch


def gguf_hf_config(path, reader=None) -> dict:
    """The HF config.json of a GGUF file, from its metadata (no tensor is read)."""
    reader = reader or _reader(path)
    arch = _check(reader, path)
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg = {"architectures": [ARCHS[arch]], "model_type": arch, "vocab_size": int(vocab),
           "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
           "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
           "num_key_value_heads": int(get("attention.head_count_kv", heads)),
           "head_dim": int(get("attention.key_length", 0) or get("rope.dimension_count", 0)
                           or hidden // heads),
           "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
           "rope_theta": float(get("rope.freq_base", 10_000.0)),
           "max_position_embeddings": int(get("context_length", 4096)),
           "tie_word_embeddings": "output.weight" not in names,
           "hidden_act": "silu", "torch_dtype": "float32"}
    for key in ("bos", "eos", "padding"):
        token = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token)
    return cfg


def gguf_tensors(path, reader=None) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file under its HF name, fp32, q/k unpermuted for Llama."""
    reader = reader or _reader(path)
    cfg = gguf_hf_config(path, reader)
    types, out = _types(), {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))   # GGUF lists ne0 first
        w = dequantize(t.data, types[t.tensor_type], shape)
        name = hf_name(t.name)
        if cfg["model_type"] == "llama" and name.endswith(
                ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            w = unpermute(w, cfg["num_attention_heads"] if "q_proj" in name
                          else cfg["num_key_value_heads"])
        out[name] = w
    return out


def convert_gguf(path, out_dir) -> str:
    """Write a GGUF file as an HF folder (config.json, model.safetensors, the tokenizer)
    that transformers and `load_pretrained` read; `out_dir` is written whole or not at all."""
    import transformers   # lazy: start-up time (the tokenizer conversion)
    path, out_dir = os.fspath(path), os.fspath(out_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty; expected a new or empty folder")
    reader = _reader(path)
    cfg = gguf_hf_config(path, reader)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-", dir=parent)
    try:
        write_folder(tmp, gguf_tensors(path, reader))
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        if _field(reader, "tokenizer.ggml.model") is not None:   # a file may hold none
            tok = transformers.AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
                local_files_only=True, trust_remote_code=False)
            template = _field(reader, "tokenizer.chat_template")
            if template and not getattr(tok, "chat_template", None):
                tok.chat_template = template
            tok.save_pretrained(tmp)
        write_identity(tmp)     # content hashes (weights, config and tokenizer files)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "opd_jax", "gguf")


def gguf_folder(path) -> str:
    """The HF folder of a GGUF file, converted once into the cache (keyed by the file's
    sha256 and the converter's version; a concurrent conversion of the same file is
    harmless: the rename is atomic)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    folder = os.path.join(cache_root(), f"{file_sha256(path)[:24]}-v{CONVERTER}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        try:
            convert_gguf(path, folder)
        except OSError:       # another process converted it first (FileExistsError too)
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise
    return folder


def is_gguf(path) -> bool:
    path = os.fspath(path)
    return path.endswith(".gguf") and os.path.isfile(path)
