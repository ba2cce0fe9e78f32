"""RoPE scaling variants against transformers: logits past the original window, both
directions through config.json, greedy KV-cache decode, and load-time refusals."""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from tests.models.hf_fixtures import hf_model

from opd_jax.models import config_from_hf, load_pretrained, save_pretrained
from opd_jax.rollout.api import generate

ORIG, MAX_POS, T = 16, 64, 40   # T > ORIG: every scaled variant differs from plain RoPE here
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
                    "mscale": 0.7, "mscale_all_dim": 0.5, "beta_fast": 16.0,
                    "beta_slow": 2.0, "truncate": False},
}


def _hf(arch, name, seed=0):
    theta = 10_000.0
    # "dynamic" rescales from max_position_embeddings itself: keep it below T.
    max_pos = ORIG if name == "dynamic" else MAX_POS
    return hf_model(arch, seed, max_position_embeddings=max_pos,
                    rope_parameters={**ROPES[name], "rope_theta": theta}, rope_theta=theta)


@nnx.jit
def _fwd(m, tokens_BxT):
    return m(tokens_BxT)


def _check(ours, torch_model):
    tokens = np.random.default_rng(0).integers(0, 96, (2, T)).astype(np.int32)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = np.asarray(_fwd(ours, tokens))
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, rel


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", list(ROPES))
def test_rope_import_export_parity(tmp_path, arch, name):
    torch_model = _hf(arch, name)
    torch_model.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    want = {k: v for k, v in ROPES[name].items()}
    assert ours.config.rope == (None if name == "default" else want)
    _check(ours, torch_model)
    save_pretrained(ours, tmp_path / "out")
    written = json.load(open(os.path.join(tmp_path, "out", "config.json")))["rope_parameters"]
    assert written == {**want, "rope_theta": 10_000.0}
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", local_files_only=True, dtype=torch.float32).eval()
    _check(ours, back)
    assert load_pretrained(tmp_path / "out").config == ours.config


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_greedy_decode_matches_hf_generate(tmp_path, name):
    torch_model = _hf("llama", name, seed=5)
    with torch.no_grad():   # peaked weights: greedy choices far from ties
        for p in torch_model.parameters():
            p.mul_(3.0) if p.ndim == 2 else None
    torch_model.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    prompts = [list(np.random.default_rng(s).integers(0, 96, n)) for s, n in ((0, 20), (1, 24))]
    new = 12    # decode crosses positions 20..35, all past the original window of 16
    res = generate(ours, [[int(t) for t in p] for p in prompts], max_new_tokens=new,
                   temperature=0.0)
    for p, got in zip(prompts, res.tokens):
        with torch.no_grad():
            out = torch_model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                                       min_new_tokens=new)
        assert got == out[0, len(p):].tolist()


BASE = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
            num_hidden_layers=1, num_attention_heads=4, rope_theta=10_000.0)


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, ["rope_type", "'ntk-by-parts'", "yarn"]),
    ({"rope_type": "linear", "factor": 0.0}, ["factor", "0.0", "positive"]),
    ({"rope_type": "linear", "factor": 0.5}, ["factor", "0.5", ">= 1"]),
    ({"rope_type": "llama3", "factor": 8.0}, ["low_freq_factor", "missing"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
      "short_factor": [1.0]}, ["short_factor", "unknown"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 16}, ["high_freq_factor", "low_freq_factor"]),
])
def test_bad_rope_fails_naming_field(rope, words):
    with pytest.raises(ValueError) as e:
        config_from_hf({**BASE, "rope_scaling": rope})
    for w in words:
        assert w in str(e.value)


def test_rope_scaling_and_parameters_must_agree():
    a = {"rope_type": "linear", "factor": 2.0}
    assert config_from_hf({**BASE, "rope_scaling": a, "rope_parameters": a}).rope == a
    with pytest.raises(ValueError, match="disagree.*factor"):
        config_from_hf({**BASE, "rope_scaling": a,
                        "rope_parameters": {"rope_type": "linear", "factor": 3.0}})
    old = config_from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope == a


def test_bad_rope_fails_before_weights_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {**BASE, "rope_scaling": {"rope_type": "su", "factor": 2.0}}))
    # no safetensors at all: the config error must come first
    with pytest.raises(ValueError, match="rope_type='su'"):
        load_pretrained(tmp_path)


def test_llama32_preset_matches_the_published_shape():
    from opd_jax.models import ModelConfig, config_to_hf
    cfg = ModelConfig.preset("llama3.2-1b")
    assert cfg.num_params() == 1_235_814_400      # Llama-3.2-1B's published parameter count
    hf = config_to_hf(cfg)
    assert hf["rope_parameters"]["rope_type"] == "llama3"
    back = config_from_hf(hf)   # HF spells the family defaults out (qkv_bias=False, ...)
    assert back == cfg.replace(qkv_bias=False, qk_norm=False, dtype=back.dtype,
                               param_dtype=back.param_dtype)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.architecture() != cfg.replace(rope_scaling=None).architecture()
