"""Tunix's sampler on a saved HF Qwen3 checkpoint (benchmark-only; needs `google-tunix`).

Tunix is an optional extra: install it apart from the project's environment, e.g.
`pip install --no-deps --target /tmp/tunix_site google-tunix google-metrax clu wrapt
sentencepiece pillow perfetto` and run with `PYTHONPATH=.:/tmp/tunix_site` (its full
dependency set would downgrade transformers/tokenizers/safetensors).
"""
from __future__ import annotations

import json
import os
import time


class IdTokenizer:
    """Prompts travel as space-separated ids; eos is an id past the vocab (never sampled),
    so every row runs to the full length."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 0  # falsy: tunix adds no bos

    def eos_id(self):
        return self.vocab

    def pad_id(self):
        return 0


def run_tunix(path, prompts, new, repeats, temperature=1.0):
    """Best wall time of `repeats` sampler calls (after one warm-up call)."""
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen3 import model as model_lib
    from tunix.models.qwen3 import params as params_lib
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(rope),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])
    model = params_lib.create_model_from_safe_tensors(path, cfg)
    P = len(prompts[0])
    sampler = sampler_lib.Sampler(
        model, IdTokenizer(cfg.vocab_size),
        sampler_lib.CacheConfig(cache_size=P + new + 16, num_layers=cfg.num_layers,
                                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    texts = [" ".join(map(str, p)) for p in prompts]

    def call(seed):
        out = sampler(texts, max_generation_steps=new, max_prompt_length=P,
                      temperature=temperature,
                      top_p=1.0 if temperature > 0 else None, top_k=None, seed=seed,
                      eos_tokens=[cfg.vocab_size])
        lengths = [len(t) for t in out.tokens]
        assert min(lengths) == new, lengths
    call(0)
    best = float("inf")
    for i in range(repeats):
        t = time.perf_counter()
        call(i + 1)
        best = min(best, time.perf_counter() - t)
    return best
