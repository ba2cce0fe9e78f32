"""Learning, not just running (long tier, `pytest -m long`): GRPO raises its on-policy reward beyond noise, and
an OPD student (the shipped base, builtin:base) distilled from two specialists fine-tuned from
it reaches 90% of each one's reward on its cell, for each objective (see
studies/learning_check.py for the setup and the settings).
The sampled-token objectives need four times the rollouts of the full-vocabulary one (about
30 CPU minutes each on 2 cores; their settings were measured on an earlier random-init toy)."""
import pytest

from studies import learning_check as lc

# Every check here trains students for many CPU minutes; beside another worker CI's slow
# tier ran out of its time with them, so the whole module is `long` (run with -m long).
pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lc.setup(str(tmp_path_factory.mktemp("learning")))


def _reaches_90pct_of_each_teacher(models, objective):
    out = lc.summarize(models, lc.train(models, objective))
    print(objective, out)
    gen = out["general/high"]
    # The arithmetic specialist knows what the student does not ...
    assert gen["before"] < 0.9 * gen["teacher"]
    # ... the student rises beyond noise (paired on the same held-out tasks) ...
    assert gen["paired_diff"] > 3 * gen["paired_se"]
    # ... to 90% of each teacher's reward on that teacher's cell.
    for cell in lc.CELLS:
        assert out[cell]["fraction_of_teacher"] >= 0.9, (cell, out[cell])


def test_full_vocab_student_reaches_90pct_of_each_teacher(models):
    _reaches_90pct_of_each_teacher(models, "deepseek_full_vocab")


@pytest.mark.parametrize("objective", ["kimi_mopd", "glm_cross_stage"])
def test_sampled_token_student_reaches_90pct_of_each_teacher(models, objective):
    _reaches_90pct_of_each_teacher(models, objective)


def test_sampled_token_student_at_the_presets_budget(models):
    """The recipes' sampled-token students spend 64 rollouts per iteration (kimi_k3 reduced:
    kimi_mopd, 64 prompts x 1 sample, 4 minibatches). learning_check's `kimi_g1` row is that
    budget (120 iterations, about 7 CPU minutes). At it the student does *not* reliably move
    toward a teacher it is far from: on the cell it does not know the same run measured
    +0.091 (se 0.042) from the base on our 2-core box and -0.000 (se 0.049) on CI's machine,
    two runs that differ only in float rounding (experiments/learning_check/README.md). What
    the presets rely on, and what this asserts: it keeps the cell it already holds (94% and
    97% of the coding teacher in those two runs) and does not drift away from the far
    teacher beyond noise (with 16-32 rollouts per step at lr >= 3e-4 it did)."""
    out = lc.summarize(models, lc.train(models, "kimi_g1"))
    print("kimi_g1", out)
    gen, cod = out["general/high"], out["coding/high"]
    assert gen["paired_diff"] > -2 * gen["paired_se"], gen
    assert cod["fraction_of_teacher"] >= 0.9, cod


def test_grpo_reward_rises(models):
    out = lc.summarize(models, lc.train(models, "grpo"))
    print("grpo", out)
    tr = out["train_reward"]
    assert tr["last5"] - tr["first5"] > 3 * tr["diff_se"], tr
