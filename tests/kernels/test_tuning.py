"""Tuned Triton block sizes: the sweep of benchmarks/gpu_kernels.py (interpret mode, tiny
shape) writes a table, and "triton" takes its knobs from it when the caller passes none;
explicit arguments win, unknown shapes fall back; bad tables fail with clear errors."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import fused_reverse_kl, triton, tuning
from tests.benchmarks import load
from tests.kernels.helpers import check_value_and_grad, kl_objective, problem

N, D, V = 37, 24, 301     # ragged for every candidate below
# chunk_v a multiple of every block_v candidate: which block_v wins depends on timing
SPACE = {"block_n": [8, 16], "block_v": [32], "block_d": [8], "vocab_splits": [0, 3], "chunk_v": [256]}


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = str(tmp_path / "triton_test.json")
    monkeypatch.setenv(tuning.ENV, path)
    yield path
    tuning.load_tables.cache_clear()


def _spy_configs(monkeypatch):
    seen = []
    real = triton.stats

    def stats(*args):
        seen.append(args[-1])
        return real(*args)
    monkeypatch.setattr(triton, "stats", stats)
    return seen


def _knobs(cfg):
    return {k: getattr(cfg, k) for k in tuning.KNOBS}


def test_sweep_writes_a_table_that_triton_reads(table, monkeypatch):
    gk = load("gpu_kernels")
    h_s, w_s, h_t, w_t, _, _ = problem(N, D, D, V)
    results = gk.sweep_shape((h_s, w_s, h_t, w_t), SPACE, reps=1, budget_s=600, tol=1e-4, interpret=True)
    # Coordinate descent from the defaults: 1 + (2 + 1 + 1 + 1 + 1) configs (vocab_splits 0 is
    # the defaults' own value: not run twice).
    assert len(results) == 7 and results[0]["blocks"] == tuning.DEFAULTS
    assert all("ms" in r for r in results), [r.get("error") for r in results]
    best = gk.best_result(results, 1e-4)
    assert best["ms"] == min(r["ms"] for r in results)
    cls = tuning.shape_class(N, D, D, V, jnp.float32)
    assert cls == "n64-d32-v512-float32"
    entry = gk.table_entry(best, results[0], N, D, V, jnp.float32, None, len(results))
    tuning.write_entries(table, jax.devices()[0].device_kind, {cls: entry})
    assert json.load(open(table))["devices"][jax.devices()[0].device_kind][cls]["measured"]["configs_tried"] == 7

    seen = _spy_configs(monkeypatch)
    fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="triton")
    assert _knobs(seen[-1]) == best["blocks"]
    # The sweep may keep the defaults: a distinctive ragged entry for the reads below.
    chosen = dict(block_n=16, block_v=32, block_d=8, chunk_v=64, vocab_splits=3)
    tuning.write_entries(table, jax.devices()[0].device_kind, {cls: chosen})
    fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="triton")
    assert _knobs(seen[-1]) == chosen
    fused_reverse_kl(h_s, w_s, h_t, w_t, implementation="triton", block_v=16)       # explicit wins
    assert _knobs(seen[-1]) == chosen | {"block_v": 16}
    h2, w2, ht2, wt2, _, _ = problem(N, D, D, 700)                                  # another class
    fused_reverse_kl(h2, w2, ht2, wt2, implementation="triton", interpret=True)
    assert _knobs(seen[-1]) == tuning.DEFAULTS
    # The table's knobs still give the reference's values and gradients (fp32 1e-5 / 1e-4).
    check_value_and_grad(lambda i: kl_objective(i, h_t, w_t, temperature=1.3), "triton", h_s, w_s, 1e-5, 1e-4)
    assert _knobs(seen[-1]) == chosen


def test_other_devices_and_implementations_ignore_the_table(table):
    cls = tuning.shape_class(N, D, D, V, jnp.float32)
    entry = dict(block_n=16, block_v=32, block_d=8, chunk_v=64, vocab_splits=3)
    tuning.write_entries(table, "NVIDIA H200", {cls: entry})
    assert tuning.lookup(N, D, D, V, jnp.float32, device_kind="NVIDIA H200") == entry
    assert tuning.lookup(N, D, D, V, jnp.float32) is None           # this CPU: not in the table
    tuning.write_entries(table, jax.devices()[0].device_kind, {cls: entry})
    assert tuning.resolve("xla", {}, N, D, D, V, jnp.float32) == tuning.DEFAULTS
    assert tuning.resolve("triton", {}, N, D, D, V, jnp.float32) == entry
    assert tuning.resolve("triton", {}, N, D, D, V, jnp.bfloat16) == tuning.DEFAULTS
    assert set(json.load(open(table))["devices"]) == {"NVIDIA H200", jax.devices()[0].device_kind}


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"devices": {}}), "expected {\"format\": 1"),
    (json.dumps({"format": 1, "devices": {"cpu": {"c": {"block_n": 64}}}}), r"missing keys \['block_v'"),
    (json.dumps({"format": 1, "devices": {"cpu": {"c": dict(tuning.DEFAULTS, block_n=48)}}}),
     r"devices\['cpu'\]\['c'\]: block_n=48; expected a power of two"),
    (json.dumps({"format": 1, "devices": {"cpu": {"c": dict(tuning.DEFAULTS, chunk_v=100)}}}),
     "chunk_v=100 is not a multiple of block_v=128"),
    (json.dumps({"format": 1, "devices": {"cpu": {"c": dict(tuning.DEFAULTS, warps=4)}}}), r"unknown keys \['warps'\]"),
])
def test_bad_tables_raise_clear_errors(table, content, match):
    with open(table, "w") as f:
        f.write(content)
    tuning.load_tables.cache_clear()
    with pytest.raises(tuning.TableError, match=match):
        tuning.lookup(N, D, D, V, jnp.float32)


def test_shipped_tables_are_valid():
    paths = tuple(sorted(p for p in os.listdir(tuning.TABLE_DIR) if p.endswith(".json")))
    assert paths and all(p.startswith("triton_") for p in paths)
    tuning.load_tables(tuple(os.path.join(tuning.TABLE_DIR, p) for p in paths))
    assert tuning.device_file_name("NVIDIA H200") == "triton_h200.json"
