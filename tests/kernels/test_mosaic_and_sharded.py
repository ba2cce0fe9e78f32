"""Mosaic (TPU) kernels in TPU interpret mode, and the vocab-parallel variant on 8 fake devices.

TPU interpret mode is ~100x slower than plain interpret: shapes here are tiny, with
blocks chosen so the grid still has ragged token and vocab tiles and two vocab chunks.
"""
from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

from tests.kernels.helpers import check_value_and_grad, kl_objective, problem, ratio_objective

MOSAIC_BLOCKS = dict(block_n=16, block_v=64, chunk_v=128)


def test_mosaic_reverse_kl_and_log_ratio():
    h_s, w_s, h_t, w_t, y, _ = problem(19, 16, 24, 150)  # 2 token tiles, 3 vocab tiles (ragged)
    kw = dict(temperature=1.4, **MOSAIC_BLOCKS)
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, **kw), "mosaic", h_s, w_s, 1e-5, 1e-4)
    check_value_and_grad(lambda i: ratio_objective(i, h_t, w_t, y, r_max=0.6, **kw), "mosaic", h_s, w_s,
                         1e-5, 1e-4)


def _mesh():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_vocab_parallel_matches_unsharded(impl):
    # V = 4 shards x 45: each shard's vocab is ragged for block_v=16; tokens split on "data".
    h_s, w_s, h_t, w_t, y, _ = problem(16, 8, 12, 180, seed=3, scale=0.6)
    kw = dict(block_n=8, block_v=16, block_d=8, chunk_v=32, mesh=_mesh(), vocab_axis="tensor", token_axis="data",
              temperature=1.3)
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, **kw), impl, h_s, w_s, 1e-5, 1e-4)
    check_value_and_grad(lambda i: ratio_objective(i, h_t, w_t, y, r_max=0.5, **kw), impl, h_s, w_s, 1e-5, 1e-4)


@pytest.mark.slow
def test_vocab_parallel_mosaic():
    h_s, w_s, h_t, w_t, y, _ = problem(16, 8, 8, 4 * 96, seed=4)
    kw = dict(block_n=8, block_v=64, chunk_v=64, mesh=_mesh(), vocab_axis="tensor")
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, **kw), "mosaic", h_s, w_s, 1e-5, 1e-4)


def test_vocab_not_divisible_by_shards_raises():
    h_s, w_s, h_t, w_t, _, _ = problem(8, 8, 8, 30)
    from pallas_kernels import fused_reverse_kl
    with pytest.raises(ValueError, match="vocab 30 is not divisible by the 4 shards"):
        fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="xla", mesh=_mesh())
