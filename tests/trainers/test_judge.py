"""The generative reward model on the training path (`rewards.judge`): greedy verdicts on the
rollout engine are deterministic and parsed into scores, the weight mixes them into the
task reward as documented, bad configs fail before any work, and a policy iteration with
the judge runs and logs its scores."""
import os

import numpy as np
import pytest

from opd_jax import envs
from opd_jax.config import load_config
from opd_jax.models import ModelConfig, save_pretrained, synthetic_tokenizer
from opd_jax.trainers import builders
from opd_jax.episodes import Episode
from opd_jax.trainers.judge import JudgeReward, mix_judge
from opd_jax.trainers.phases import Batcher
from opd_jax.trainers.run_policy import train_policy
from tests.models.helpers import ScriptedPolicy, random_model, script_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=512)
SMALL = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
         "--config.model.num_layers=1", "--config.model.head_dim=8",
         "--config.rollout.prompts_per_step=4", "--config.rollout.group_size=2",
         "--config.rollout.sampling.max_new_tokens=8", "--config.rollout.sampling.max_turns=2",
         "--config.train.steps=1", "--config.eval.n=2", "--config.eval.sampling.max_new_tokens=8"]


def _tasks(n):
    return list(envs.TaskSource("chain", size=n, seed=0, difficulty=1, effort="think_off"))


def test_greedy_verdicts_are_deterministic():
    tok = synthetic_tokenizer()
    tasks = _tasks(4)
    responses = ["<think>x</think>12", "7", "-3", "abc"]
    a = JudgeReward(random_model(CFG, seed=0, std=0.3), tok, max_new_tokens=6)
    b = JudgeReward(random_model(CFG, seed=0, std=0.3), tok, max_new_tokens=6)
    prompts = [a.rm.render(t, r) for t, r in zip(tasks, responses)]
    verdicts = a.generate(prompts)
    assert verdicts == a.generate(prompts) == b.generate(prompts)
    assert len(verdicts) == 4 and all(len(tok.encode(v, add_special_tokens=False)) <= 6
                                      for v in verdicts)
    scores = [r.score for r in a.score(tasks, responses)]
    assert scores == [r.score for r in b.score(tasks, responses)]
    assert scores == [a.rm.parse(v).score for v in verdicts]
    assert all(0.0 <= s <= 1.0 for s in scores)


@pytest.fixture(scope="module")
def scripted_judge():
    """A judge that writes fixed verdicts (one per row) for known prompts."""
    tok = synthetic_tokenizer()
    tasks = _tasks(5)
    responses = ["<think>1+2</think>3", "4", "5", "6", "7" * 600]
    verdicts = ["Score: 7", "<think>close 3</think>Score: 9", "no idea", "Score: 15",
                "I give it 4"]
    probe = JudgeReward(random_model(CFG, seed=1), tok, max_new_tokens=32)
    fitted = [probe.fit(t, r)[0] for t, r in zip(tasks, responses)]
    rows = [probe._ids(probe.rm.render(t, f)) + tok.encode(v + "<eos>",
                                                           add_special_tokens=False)
            for t, f, v in zip(tasks, fitted, verdicts)]
    model = ScriptedPolicy(random_model(CFG, seed=1), script_rows(rows))
    return JudgeReward(model, tok, max_new_tokens=32), tasks, responses, verdicts


def test_scripted_verdicts_are_parsed_into_scores(scripted_judge):
    judge, tasks, responses, verdicts = scripted_judge
    res = judge.score(tasks, responses)
    assert [r.score for r in res] == pytest.approx([0.7, 0.9, 0.0, 1.0, 0.4])
    assert ["error" in r.details for r in res] == [False, False, True, False, False]
    assert [r.details.get("raw_score") for r in res] == [7.0, 9.0, None, 15.0, 4.0]
    # the 600-character answer was cut to fit the judge's 512 positions
    assert [r.details["truncated"] for r in res] == [False] * 4 + [True]
    eps = [Episode(t, [1], text=r) for t, r in zip(tasks, responses)]
    judge_B, m = judge(eps)
    assert judge_B.tolist() == pytest.approx([0.7, 0.9, 0.0, 1.0, 0.4])
    assert m["reward/judge_mean"] == pytest.approx(0.6)
    assert m["reward/judge_error_frac"] == pytest.approx(0.2)
    assert m["reward/judge_truncated_frac"] == pytest.approx(0.2)


def test_weight_mixes_as_documented():
    task_B, judge_B = np.array([1.0, 0.0, 0.5, 0.5]), np.array([0.5, 1.0, 0.0, 1.0])
    assert mix_judge(task_B, judge_B, 0.2).tolist() == pytest.approx([1.1, 0.2, 0.5, 0.7])
    assert mix_judge(task_B, judge_B, 0.0).tolist() == pytest.approx(task_B.tolist())
    # In the batch: a group with equal task rewards gets advantages from the judge alone.
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"),
                      ["--config.rollout.group_size=2", "--config.rewards.judge.weight=0.5"])
    t = _tasks(1)[0]
    eps = [Episode(t, [1, 20, 21], [30, 31], [1, 1], [-0.5, -0.5], reward=1.0)
           for _ in range(2)]
    mc = builders.planned_model_config(cfg.model)
    _, plain, _ = Batcher(cfg, mc)(eps)
    _, judged, metrics = Batcher(cfg, mc)(eps, np.array([0.2, 0.8], np.float32))
    assert plain["adv"].tolist() == [0.0, 0.0]
    assert judged["adv"][0] < 0 < judged["adv"][1]
    assert metrics["reward/mean"] == 1.0          # the logged reward stays the verifier's


@pytest.mark.parametrize("override,match", [
    ("--config.rewards.judge.weight=-0.5", r"rewards.judge.weight=-0.5: expected a finite"),
    ("--config.rewards.judge.weight=0.3", r"weight=0.3: expected 0 while rewards.judge.path"),
    ("--config.rewards.judge.path=/nonexistent/judge",
     r"rewards.judge.path='/nonexistent/judge': no checkpoint there"),
    ("--config.rewards.judge.path=builtin:nope", r"rewards.judge.path='builtin:nope'"),
    ("JUDGE --config.rewards.judge.max_new_tokens=0",
     r"rewards.judge.max_new_tokens=0: expected an int >= 1"),
    ("JUDGE --config.rewards.judge.rubric= ", r"rewards.judge.rubric=' ': expected a non-empty"),
    ("JUDGE --config.rewards.judge.max_new_tokens=600",
     r"max_new_tokens=600: expected fewer than the judge's max_position_embeddings=512"),
])
def test_bad_judge_config_fails_before_any_work(tmp_path, override, match):
    extra = override.split(" ", 1)
    if extra[0] == "JUDGE":   # a valid judge path, then the bad value
        save_pretrained(random_model(CFG, seed=2), tmp_path / "judge")
        extra = [f"--config.rewards.judge.path={tmp_path / 'judge'}", extra[1]]
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"), SMALL + extra)
    with pytest.raises(ValueError, match=match):
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()      # nothing was written


def test_judge_vocabulary_must_match(tmp_path):
    save_pretrained(random_model(CFG.replace(vocab_size=256), seed=2), tmp_path / "judge")
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"),
                      SMALL + [f"--config.rewards.judge.path={tmp_path / 'judge'}"])
    with pytest.raises(ValueError, match="judge's vocabulary has 256 tokens, the run's model 128"):
        train_policy(cfg, str(tmp_path / "run"), progress=False)


def test_one_policy_iteration_with_the_judge(tmp_path):
    save_pretrained(random_model(CFG, seed=2, std=0.3), tmp_path / "judge")
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny"),
                      SMALL + [f"--config.rewards.judge.path={tmp_path / 'judge'}",
                               "--config.rewards.judge.weight=0.5",
                               "--config.rewards.judge.max_new_tokens=4"])
    out = train_policy(cfg, str(tmp_path / "run"), progress=False)
    last = out["history"][-1]
    assert last["step"] == 1
    assert 0.0 <= last["reward/judge_mean"] <= 1.0
    assert 0.0 <= last["reward/judge_error_frac"] <= 1.0
    assert last["time/judge"] > 0 and np.isfinite(last["loss"])
