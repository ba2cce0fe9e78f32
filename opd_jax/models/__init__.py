"""Decoder-only LMs (Llama / Qwen2 / Qwen3) in Flax NNX, Hugging Face I/O and tokenizers."""
from opd_jax.models.config import ModelConfig
from opd_jax.models.hf import config_from_hf, config_to_hf, load_pretrained, save_pretrained
from opd_jax.models.tokenizers import (build_qwen_tokenizer, check_tokenizer_fits,
                                       load_tokenizer, synthetic_tokenizer)
from opd_jax.models.transformer import KVCache, Transformer

__all__ = [
    "ModelConfig", "Transformer", "KVCache", "load_pretrained", "save_pretrained",
    "config_from_hf", "config_to_hf", "load_tokenizer", "synthetic_tokenizer",
    "build_qwen_tokenizer", "check_tokenizer_fits",
]
