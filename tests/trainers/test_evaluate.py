"""Held-out evaluation: cells, aggregation, files, and the `opd-jax eval` command."""
import csv
import json
import os

import pytest

from opd_jax import envs
from opd_jax.cli import main
from opd_jax.models import ModelConfig, save_pretrained, synthetic_tokenizer
from opd_jax.episodes import Episode, SamplingConfig
from opd_jax.trainers.evaluate import (aggregate, evaluate_model,
                                       format_rows, heldout_tasks, write_rows)
from tests.models.helpers import random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=True)


def test_heldout_tasks_cover_the_grid_and_are_not_training_tasks():
    tasks = heldout_tasks({"general": "arithmetic", "coding": "code_expr"}, ("low", "max"),
                          n=5, seed=3, difficulty=2)
    cells = [f"{t.domain}/{t.effort}" for t in tasks]
    assert cells == ["general/low"] * 5 + ["general/max"] * 5 + ["coding/low"] * 5 + \
        ["coding/max"] * 5
    # Every effort of a domain sees the same problems; all of them from the eval split.
    assert [t.prompt for t in tasks[:5]] == [t.prompt for t in tasks[5:10]]
    assert {t.split for t in tasks} == {"eval"}
    train = list(envs.TaskSource("arithmetic", size=500, seed=3, difficulty=2, effort="low"))
    assert not {t.prompt for t in train} & {t.prompt for t in tasks[:5]}
    again = list(envs.TaskSource("arithmetic", size=5, seed=3, difficulty=2, effort="low",
                                 split="eval"))
    assert [t.prompt for t in again] == [t.prompt for t in tasks[:5]]


def test_heldout_bad_input():
    with pytest.raises(ValueError, match="eval n=0"):
        heldout_tasks({"general": "arithmetic"}, ("high",), n=0, seed=0)
    with pytest.raises(ValueError, match="family 'code_expr' is in domain 'coding'"):
        heldout_tasks({"general": "code_expr"}, ("high",), n=2, seed=0)


def test_aggregate_means_per_cell():
    t_hi = envs.TaskSource("arithmetic", size=3, seed=0, effort="high")
    t_lo = envs.TaskSource("arithmetic", size=1, seed=0, effort="low")
    eps = [Episode(t_hi[0], [1], response_mask=[1, 1, 0], reward=1.0, info={"correct": 1.0}),
           Episode(t_lo[0], [1], response_mask=[1], reward=0.5, info={"correct": 1.0}),
           Episode(t_hi[1], [1], response_mask=[1, 1, 1, 1], reward=0.0, info={}),
           Episode(t_hi[2], [1], response_mask=[1, 0, 1], reward=0.8, info={"correct": 1.0})]
    rows = aggregate(eps)
    assert [r["cell"] for r in rows] == ["general/high", "general/low"]
    hi = rows[0]
    assert hi["n"] == 3 and hi["difficulty"] == 1 and hi["family"] == "arithmetic"
    assert hi["reward"] == pytest.approx(0.6, abs=1e-6)
    assert hi["pass_rate"] == pytest.approx(2 / 3, abs=1e-6)
    assert hi["length"] == pytest.approx((2 + 4 + 2) / 3, abs=1e-6)
    assert hi["rewards"] == [1.0, 0.0, 0.8]      # per task, in order: paired comparisons
    assert "| general/low | 1 | 0.500 | 1.000 | 1.0 |" in format_rows(rows)


def test_evaluate_model_is_deterministic_and_written(tmp_path):
    model, tok = random_model(TINY, seed=0), synthetic_tokenizer()
    kw = dict(n=3, seed=1, sampling=SamplingConfig(max_new_tokens=6, temperature=0.0,
                                                    max_turns=1), batch_size=4)
    rows = evaluate_model(model, tok, {"general": "arithmetic"}, ("low", "high"), **kw)
    assert rows == evaluate_model(model, tok, {"general": "arithmetic"}, ("low", "high"), **kw)
    assert [r["cell"] for r in rows] == ["general/low", "general/high"]
    assert all(r["n"] == 3 and 0 < r["length"] <= 6 for r in rows)
    jpath, cpath = write_rows(rows, str(tmp_path / "out"))
    assert json.load(open(jpath)) == rows
    read = list(csv.DictReader(open(cpath)))
    assert [r["cell"] for r in read] == ["general/low", "general/high"]
    assert float(read[1]["reward"]) == pytest.approx(rows[1]["reward"])


def test_eval_command(tmp_path, capsys):
    ckpt = tmp_path / "hf"
    save_pretrained(random_model(TINY, seed=0), str(ckpt))
    out = tmp_path / "eval"
    rc = main(["eval", "--checkpoint", str(ckpt), "--config",
               os.path.join(ROOT, "opd_jax/configs/eval.py:general"), "--config.eval.n=2",
               "--config.eval.sampling.max_new_tokens=4", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for cell in ("general/low", "general/high", "general/max"):
        assert f"| {cell} | 2 |" in printed
    assert len(json.load(open(out / "eval.json"))) == 3
    rc = main(["eval", "--checkpoint", str(tmp_path / "nope"), "--config",
               os.path.join(ROOT, "opd_jax/configs/eval.py:general")])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_heldout_tasks_are_distinct_problems_or_refused():
    # json_call's eval split at difficulty 2 holds a few hundred calls: 128 draws of it would
    # repeat some; the held-out tasks are 128 distinct ones, every effort the same problems.
    fam = envs.get_family("json_call")
    tasks = heldout_tasks({"agent": "json_call"}, ("chat",), n=128, seed=0, difficulty=2)
    canon = [fam.canonical_form(t.prompt, t.reference) for t in tasks]
    assert len(tasks) == 128 and len(set(canon)) == 128
    raw = [fam.canonical_form(t.prompt, t.reference) for t in envs.TaskSource(
        "json_call", size=128, seed=0, difficulty=2, split="eval")]
    assert len(set(raw)) < 128          # what a plain draw of 128 gives: repeats
    # A cell whose eval split is smaller than n is refused with the numbers.
    with pytest.raises(ValueError, match=r"json_call at difficulty 1: only \d+ distinct "
                                         r"eval-split problems .* fewer than n=64"):
        heldout_tasks({"agent": "json_call"}, ("chat",), n=64, seed=0, difficulty=1)
