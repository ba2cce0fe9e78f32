"""Decoder-only LMs (Llama / Qwen2 / Qwen3) in Flax NNX, Hugging Face I/O, tokenizers and
`ModelRef`, the reference to a checkpoint that students, teachers and judges share."""
from opd_jax.models.config import ModelConfig
from opd_jax.models.hf import config_from_hf, config_to_hf, load_pretrained, save_pretrained
from opd_jax.models.ref import ModelRef, check_tokenizer, model_bytes, resolve_tokenizer
from opd_jax.models.tokenizers import (bos_ids, build_qwen_tokenizer, build_tokenizer,
                                       check_tokenizer_fits, load_tokenizer,
                                       synthetic_tokenizer, tokenizer_fingerprint,
                                       tokenizer_meta)
from opd_jax.models.transformer import KVCache, Transformer

__all__ = [
    "ModelConfig", "ModelRef", "Transformer", "KVCache", "load_pretrained", "save_pretrained",
    "config_from_hf", "config_to_hf", "load_tokenizer", "synthetic_tokenizer",
    "bos_ids", "build_qwen_tokenizer", "build_tokenizer", "check_tokenizer", "check_tokenizer_fits",
    "model_bytes", "resolve_tokenizer", "tokenizer_fingerprint", "tokenizer_meta",
]
