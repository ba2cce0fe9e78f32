"""Learning, not just running (slow tier): GRPO raises its on-policy reward beyond noise, and
a full-vocabulary OPD student distilled from two specialists reaches 90% of each one's
reward on its cell (see opd_jax/recipes/learning_check.py for the setup and the settings;
its command also measures the sampled-token objectives, which do not get there at a CPU
budget: numbers in experiments/kimi_k3/README.md)."""
import pytest

from opd_jax.recipes import learning_check as lc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lc.setup(str(tmp_path_factory.mktemp("learning")))


def test_full_vocab_student_reaches_90pct_of_each_teacher(models):
    out = lc.summarize(models, lc.train(models, "deepseek_full_vocab"))
    print(out)
    gen = out["general/high"]
    # The arithmetic specialist knows what the student does not ...
    assert gen["before"] < 0.9 * gen["teacher"]
    # ... the student rises beyond noise (paired on the same held-out tasks) ...
    assert gen["paired_diff"] > 3 * gen["paired_se"]
    # ... to 90% of each teacher's reward on that teacher's cell.
    for cell in lc.CELLS:
        assert out[cell]["fraction_of_teacher"] >= 0.9, (cell, out[cell])


def test_grpo_reward_rises(models):
    out = lc.summarize(models, lc.train(models, "grpo"))
    print("grpo", out)
    tr = out["train_reward"]
    assert tr["last5"] - tr["first5"] > 3 * tr["diff_se"], tr
