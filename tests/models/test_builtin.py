"""The shipped base model: loads by name, matches its card, scores like its card says."""
import json
import os

import jax
import pytest
from flax import nnx

from opd_jax.models import ModelRef
from opd_jax.models.builtin import builtin_path, resolve_model_path
from studies.base_model import evaluate_card

CARD = os.path.join(builtin_path("base"), "card.json")   # shipped with the package


def test_builtin_base_loads_and_matches_its_card():
    card = json.load(open(CARD))
    model = ModelRef("builtin:base").load()
    n = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == card["n_params"]
    for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
        assert getattr(model.config, k) == card["model"][k], k
    assert os.path.getsize(os.path.join(builtin_path("base"), "model.safetensors")) <= 25e6


def test_builtin_base_scores_within_noise_of_its_card():
    card = json.load(open(CARD))
    rows = evaluate_card("builtin:base", n=card["eval"]["n"], seeds=(0,), difficulties=(2,),
                         families={"general": "chain"})
    want = {(r["effort"]): r["reward"] for r in card["rows"]
            if r["seed"] == 0 and r["family"] == "chain" and r["difficulty"] == 2}
    for r in rows:   # same problems, greedy: the same numbers up to float noise
        assert abs(r["reward"] - want[r["effort"]]) <= 1.0 / r["n"], (r, want)


def test_unknown_builtin_is_a_clear_error():
    with pytest.raises(ValueError, match="builtin:nope"):
        resolve_model_path("builtin:nope")
    assert resolve_model_path("runs/x") == "runs/x"
