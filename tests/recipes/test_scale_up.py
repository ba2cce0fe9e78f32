"""Scale-up estimates: real-size models are built abstractly and sharded by the rules."""
import jax.numpy as jnp
import pytest

from opd_jax.models import ModelConfig
from opd_jax.recipes import scale_up


def test_sharded_bytes_split_over_fsdp():
    cfg = ModelConfig.preset("qwen3-1.7b")
    mesh = scale_up.abstract_mesh((4, 8, 1))
    total, per_device = scale_up.sharded_bytes(cfg, mesh, jnp.float32)
    assert total / 4 == pytest.approx(1.72e9, rel=0.01)     # Qwen3-1.7B has 1.72B params
    # fsdp=8 shards every large matrix; only norms (tiny) stay replicated.
    assert total / 8 <= per_device <= total / 8 * 1.01


def test_estimates_cover_every_recipe_and_mesh():
    rows = [scale_up.estimate(r, m) for r in scale_up.RECIPES for m in scale_up.MESHES]
    assert len(rows) == 6
    for r in rows:
        g = r["per_device_gib"]
        assert g["adam"] == pytest.approx(2 * g["params"])
        assert r["total_gib"] == pytest.approx(sum(g.values()))
    ds = next(r for r in rows if r["recipe"] == "deepseek_v4" and r["mesh"] == "8xH100")
    km = next(r for r in rows if r["recipe"] == "kimi_k3" and r["mesh"] == "8xH100")
    # Same teachers and cache bound; the full-vocab recipe also caches teacher hidden states.
    assert ds["per_device_gib"]["teacher_cache"] > km["per_device_gib"]["teacher_cache"]
    assert "| deepseek_v4 | 8xH100 | 32 (16) |" in scale_up.table(rows)
