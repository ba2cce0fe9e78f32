"""Learning, not just running (slow tier): an OPD student distilled from two different
teachers moves toward them on held-out tasks (see opd_jax/recipes/learning_check.py for the
setup and the full measurement over every objective)."""
import pytest

from opd_jax.recipes import learning_check as lc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lc.setup(str(tmp_path_factory.mktemp("learning")))


def test_full_vocab_opd_student_learns_from_its_teachers(models):
    out = lc.summarize(models, lc.train(models, "deepseek_full_vocab", ITERATIONS))
    print(out)
    gen, code = out["general/high"], out["coding/high"]
    # The student starts well below the arithmetic teacher ...
    assert gen["before"] < 0.9 * gen["teacher"]
    # ... and rises beyond noise (paired on the same held-out tasks) ...
    assert gen["paired_diff"] > 3 * gen["paired_se"]
    # ... while keeping what it already shares with the coding teacher.
    assert code["fraction_of_teacher"] >= 0.9


ITERATIONS = 120
