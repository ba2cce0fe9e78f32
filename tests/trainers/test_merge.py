import jax
import numpy as np
import pytest
from flax import nnx

from opd_jax.models import ModelConfig
from opd_jax.teachers import merge_models
from tests.models.helpers import random_model

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8)


def _leaves(m):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(m))]


def test_average_and_task_arithmetic():
    a, b, base = random_model(CFG, seed=1), random_model(CFG, seed=2), random_model(CFG, seed=3)
    avg = merge_models([a, b], weights=[0.25, 0.75])
    for x, ya, yb in zip(_leaves(avg), _leaves(a), _leaves(b)):
        np.testing.assert_allclose(x, 0.25 * ya + 0.75 * yb, rtol=1e-6, atol=1e-7)
    ta = merge_models([a, b], base=base, method="task_arithmetic", scale=2.0)
    for x, ya, yb, y0 in zip(_leaves(ta), _leaves(a), _leaves(b), _leaves(base)):
        np.testing.assert_allclose(x, y0 + 2.0 * (0.5 * (ya - y0) + 0.5 * (yb - y0)),
                                   rtol=1e-5, atol=1e-6)
    tokens = np.zeros((1, 4), np.int32)
    assert avg(tokens).shape == (1, 4, 32)                 # a working model


def test_merge_errors():
    a = random_model(CFG)
    with pytest.raises(ValueError, match="must be non-negative and sum to 1"):
        merge_models([a, a], weights=[0.7, 0.7])
    with pytest.raises(ValueError, match="needs base="):
        merge_models([a], method="task_arithmetic")
    with pytest.raises(ValueError, match="different architecture"):
        merge_models([a, random_model(CFG.replace(num_layers=2))])
    with pytest.raises(ValueError, match="merge method 'ties'"):
        merge_models([a], method="ties")
