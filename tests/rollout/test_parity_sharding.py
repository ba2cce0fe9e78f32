"""Greedy parity with transformers' generate (Llama, Qwen3) and sharded generation."""
import jax
import numpy as np
import pytest
import torch
import transformers
from rollout_fixtures import random_model

from opd_jax.models import load_pretrained
from opd_jax.rollout import generate
from opd_jax.sharding import make_mesh, shard_model

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
PROMPTS = [[5, 17, 33, 2, 8, 40, 41], [9, 10], [60, 61, 62, 63]]


def hf_checkpoint(arch, path):
    kw = dict(TINY, model_type=arch, rope_theta=10_000.0)
    if arch == "qwen3":
        kw["head_dim"] = 32
    config = transformers.AutoConfig.for_model(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, tie-free argmax
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_generate(arch, tmp_path):
    hf = hf_checkpoint(arch, tmp_path)
    P, n = max(map(len, PROMPTS)), 10
    ids = torch.zeros((len(PROMPTS), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(PROMPTS):  # left padding, as generate expects
        ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                          do_sample=False, pad_token_id=0).numpy()[:, P:]
    expected = []
    for row in out.tolist():  # HF pads rows after their eos
        expected.append(row[:row.index(eos) + 1] if eos is not None and eos in row else row)
    ours = generate(load_pretrained(tmp_path), PROMPTS, max_new_tokens=n, temperature=0.0,
                    stop_token_ids=() if eos is None else [eos])
    assert ours.tokens == expected


def test_sharded_generation_matches_single_device():
    model = random_model(seed=0)
    prompts = [[1, 20, 30, 40, 50], [1, 60], [1, 70, 80], [1, 9, 9, 9]]
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3, max_len=64)
    single = generate(model, prompts, **kw)
    mesh = make_mesh((2, 2, 2))  # data, fsdp, tensor
    sharded_model = shard_model(random_model(seed=0), mesh)
    sharded = generate(sharded_model, prompts, mesh=mesh, **kw)
    assert sharded.tokens == single.tokens
    for a, b in zip(sharded.logprobs, single.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    spec = sharded.batch.tokens_BxL.sharding
    assert len(jax.devices()) == 8 and len(spec.device_set) == 8
