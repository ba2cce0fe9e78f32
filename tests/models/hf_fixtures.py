"""Tiny random HF checkpoints built offline with transformers (torch is a test-only oracle)."""
from __future__ import annotations

import numpy as np
import torch
import transformers

# Qwen3 uses head_dim 32 != hidden / heads = 16, as the real Qwen3 models do.
TINY = {
    "llama": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=10_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
}


def hf_model(arch: str, seed: int = 0, **overrides):
    """A random fp32 HF CausalLM; norms and biases randomised too so their layout is tested."""
    kw = {**TINY[arch], **overrides}
    config = transformers.AutoConfig.for_model(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, tokens_BxT: np.ndarray, attention_mask_BxT=None, position_ids=None):
    with torch.no_grad():
        kw = {}
        if attention_mask_BxT is not None:
            kw["attention_mask"] = torch.tensor(np.asarray(attention_mask_BxT), dtype=torch.long)
        if position_ids is not None:
            kw["position_ids"] = torch.tensor(np.asarray(position_ids), dtype=torch.long)
        out = model(input_ids=torch.tensor(np.asarray(tokens_BxT), dtype=torch.long), **kw)
    return out.logits.float().numpy()
