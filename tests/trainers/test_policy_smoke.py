"""The policy-trainer driver end to end at the smallest size: every objective runs, logs,
checkpoints and resumes; bad teacher banks fail before any work."""
import json
import os

import pytest

from opd_jax.config import load_config
from opd_jax.models import ModelConfig, save_pretrained
from opd_jax.models.hf import read_config
from opd_jax.trainers.metrics import read_metrics
from opd_jax.trainers.run_policy import train_policy
from tests.models.helpers import random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
         "--config.model.num_layers=1", "--config.model.head_dim=8",
         "--config.rollout.prompts_per_step=8", "--config.rollout.sampling.max_new_tokens=8",
         "--config.rollout.sampling.max_turns=2", "--config.train.ckpt_every=1",
         "--config.eval.n=4", "--config.eval.sampling.max_new_tokens=8"]


def _teacher(path, vocab=128, seed=1):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=48, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=True)
    save_pretrained(random_model(cfg, seed=seed), path)
    return str(path)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("grpo")
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"),
                      SMALL + ["--config.train.steps=2", "--config.rollout.group_size=2",
                               "--config.rollout.prompts_per_step=4"])
    return cfg, workdir, train_policy(cfg, str(workdir), progress=False)


def test_grpo_runs_and_logs(grpo_run):
    _, _, out = grpo_run
    assert [h["step"] for h in out["history"]] == [1, 2]
    for key in ("reward/mean", "reward/general/high", "icepop_masked_frac", "mismatch_mean",
                "clip_frac", "entropy", "tokens_per_s", "response_len"):
        assert key in out["history"][-1], key
    # IcePop compares the training forward with the sampler: same weights, same numbers.
    assert abs(out["history"][0]["mismatch_mean"] - 1.0) < 1e-4


@pytest.mark.slow
def test_grpo_resumes(grpo_run):
    cfg, workdir, _ = grpo_run
    cfg.unlock()
    cfg.train.steps = 3
    resumed = train_policy(cfg, str(workdir), progress=False)
    assert [h["step"] for h in resumed["history"]] == [3]
    assert [m["step"] for m in read_metrics(str(workdir))] == [1, 2, 3]


@pytest.mark.parametrize("objective", [
    "kimi_mopd",
    pytest.param("glm_cross_stage", marks=pytest.mark.slow),
    pytest.param("deepseek_full_vocab", marks=pytest.mark.slow),
    "topk_distill",
])
def test_opd_objectives_run(tmp_path, objective):
    teacher = _teacher(tmp_path / "teacher")
    cfg = load_config(os.path.join(ROOT, f"opd_jax/configs/opd.py:{objective}"),
                      SMALL + ["--config.train.steps=1",
                               f"--config.teachers.paths={{'general/high': '{teacher}', "
                               f"'general': '{teacher}'}}"])
    out = train_policy(cfg, str(tmp_path / "run"), progress=False)
    last = out["history"][-1]
    key = "general/high" if objective == "kimi_mopd" else "general"
    assert last[f"teacher/{key}/tokens"] > 0
    assert f"teacher/{key}/" + ("kl" if objective in ("deepseek_full_vocab", "topk_distill")
                                else "log_ratio") in last
    # Held-out evaluation at the end, per cell and per teacher, also written as JSON and CSV.
    assert 0.0 <= last[f"teacher/{key}/heldout_reward"] <= 1.0
    assert last["heldout/general/high/reward"] == last[f"teacher/{key}/heldout_reward"]
    rows = json.load(open(tmp_path / "run" / "eval" / "eval.json"))
    assert [r["cell"] for r in rows] == ["general/high"] and rows[0]["n"] == 4
    assert (tmp_path / "run" / "eval" / "eval.csv").read_text().startswith("cell,domain,effort")
    cache = json.load(open(tmp_path / "run" / "teacher_cache.json"))
    assert cache["stats"]["loads"] == 1
    # Compute: every rollout row went through the student once and its teacher once, and
    # was trained on in every PPO epoch; FLOPs 2N / 2N_T / 6N per token.
    rec = json.load(open(tmp_path / "run" / "compute.json"))
    tok, n, n_t = rec["tokens"], rec["params"], rec["teacher_params"][key]
    assert tok["rollouts"] == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert 0 < tok["sampled"] < tok["rollout"] and tok["teacher"] == {key: tok["rollout"]}
    assert tok["trained"] == cfg.rl.ppo_epochs * tok["rollout"]
    assert tok["forward"] in (0, tok["rollout"], 2 * tok["rollout"])
    assert n_t == read_config(teacher).num_params()
    assert rec["flops"]["teacher"] == 2.0 * n_t * tok["rollout"]
    assert rec["flops"]["train"] == 6.0 * n * tok["trained"]
    assert rec["flops"]["total"] == sum(v for k, v in rec["flops"].items() if k != "total")


def test_full_vocab_confidence_weighted_ensemble_runs(tmp_path):
    """teachers.routing='uniform' + weighting='confidence': every teacher scores every row,
    weights per token from their entropies; the per-teacher weight metrics sum to 1 and
    each teacher's load is the whole batch."""
    a, b = _teacher(tmp_path / "a"), _teacher(tmp_path / "b", seed=5)
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:deepseek_full_vocab"),
                      SMALL + ["--config.train.steps=1", "--config.teachers.routing=uniform",
                               "--config.teachers.weighting=confidence",
                               f"--config.teachers.paths={{'a': '{a}', 'b': '{b}'}}"])
    last = train_policy(cfg, str(tmp_path / "run"), progress=False)["history"][-1]
    w = [last["teacher/a/weight"], last["teacher/b/weight"]]
    assert abs(sum(w) - 1.0) < 1e-5 and min(w) > 0 and w[0] != w[1], w
    assert last["teacher/a/load"] == last["teacher/b/load"] == 1.0
    assert last["teacher/a/tokens"] == last["teacher/b/tokens"] > 0
    kimi = os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd")
    for over, msg in (("--config.teachers.weighting=confidence", "weighting='confidence'"),
                      ("--config.teachers.routing=uniform", "routing='uniform'")):
        bad = load_config(kimi, SMALL + [over, f"--config.teachers.paths={{'a': '{a}'}}"])
        with pytest.raises(ValueError, match=msg):
            train_policy(bad, str(tmp_path / "bad"), progress=False)


def test_opd_bad_banks_fail_early(tmp_path):
    small = _teacher(tmp_path / "t64", vocab=64)
    base = os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd")
    cfg = load_config(base, SMALL + [f"--config.teachers.paths={{'general/high': '{small}'}}"])
    with pytest.raises(ValueError, match="teacher vocab 64 != student vocab 128"):
        train_policy(cfg, str(tmp_path / "a"), progress=False)
    cfg = load_config(base, SMALL + ["--config.teachers.paths={'general/high': '/nope'}"])
    with pytest.raises(FileNotFoundError, match="teacher 'general/high': checkpoint '/nope' does not exist"):
        train_policy(cfg, str(tmp_path / "b"), progress=False)
    good = _teacher(tmp_path / "t128")
    cfg = load_config(base, SMALL + [f"--config.teachers.paths={{'general/high': '{good}'}}",
                                     "--config.tasks.efforts=('high', 'max')"])
    with pytest.raises(KeyError, match="no teacher for \\(domain, effort\\) 'general/max'"):
        train_policy(cfg, str(tmp_path / "c"), progress=False)
    topk = os.path.join(ROOT, "opd_jax/configs/opd.py:topk_distill")
    cfg = load_config(topk, SMALL + [f"--config.teachers.paths={{'general': '{good}'}}",
                                     "--config.objective.options.top_k=129"])
    with pytest.raises(ValueError, match="top_k=129: expected at most the vocabulary size 128"):
        train_policy(cfg, str(tmp_path / "d"), progress=False)
    assert not (tmp_path / "d" / "teacher_cache.json").exists()
    ds = os.path.join(ROOT, "opd_jax/configs/opd.py:deepseek_full_vocab")
    cfg = load_config(ds, SMALL + [f"--config.teachers.paths={{'a': '{good}', 'b': '{good}'}}",
                                   "--config.teachers.routing=mixture",
                                   "--config.teachers.weights={'general': {'a': 0.5, 'b': 0.6}}"])
    with pytest.raises(ValueError, match="teacher weights for 'general/high' sum to 1.1"):
        train_policy(cfg, str(tmp_path / "d"), progress=False)
    assert not any((tmp_path / d).exists() for d in "abcd")
