"""Learning, not just running (long tier, `pytest -m long`), on the shipped base and the
testbed: seed 0 of the speed study (studies/speed_study.py; its 3-seed results are committed in
experiments/speed_study) with one learning rate per method, each the study's best:

* GRPO from `builtin:base` on general/max + coding/max (chain, code_trace at difficulty 3)
  raises its held-out general/max pass rate beyond 3 se, without losing coding/max beyond
  2 se;
* full-vocabulary OPD from the same start, distilling that GRPO run, gains on general/max
  beyond 3 se and keeps at least half of the teacher's gain there;
* the clipped sampled-token signal (kimi_mopd) gains on general/max beyond 3 se.

Every model is evaluated greedily on the seed's first 512 eval-split problems per cell, paired
with the start. The committed study's seed-0 and seed-1 runs (commit 7e7b5be) score, on those
512 problems, general/max gains of +0.131 / +0.135 for the teacher (6.6 / 6.8 se), +0.113 /
+0.146 for full-vocab OPD at lr 1e-4 (5.6 / 7.6 se) and +0.121 / +0.104 for sampled-token
OPD at lr 5e-5 (6.1 / 5.1 se); coding/max +0.057 / +0.025 for the teacher. (At the study's
128 problems the full-vocab gain of seed 0 is 2.9 se: too few problems for this check.) The
runs here evaluate in-run every 10 iterations instead of 2 (evaluation does not touch
training). About 20 CPU minutes on 2 idle cores.
"""

import ml_collections
import pytest

from opd_jax.config import load_config
from opd_jax.models import build_tokenizer
from opd_jax.recipes import kimi_k3
from opd_jax.recipes import report as rp
from opd_jax.recipes.pipeline import run_stage
from studies import speed_study as ss

pytestmark = [pytest.mark.slow, pytest.mark.long]

SEED = 0
TEACHER_LR, FULL_LR, SAMPLED_LR = 5e-5, 1e-4, 5e-5     # the study's best per method
GENERAL, CODING = ss.NAMES
EVAL_N = 512


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    sw = str(tmp_path_factory.mktemp("learning") / f"seed{SEED}")
    c = ml_collections.ConfigDict(load_config(ss.CONFIG).to_dict())
    tokenizer = build_tokenizer(c.tokenizer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ss, "EVAL_EVERY", 10)
        teacher = ss.grpo_stage(c, SEED, TEACHER_LR)
        stages = [teacher, ss.opd_stage(c, SEED, "deepseek_full_vocab", FULL_LR, teacher.name),
                  ss.opd_stage(c, SEED, "kimi_mopd", SAMPLED_LR, teacher.name)]
        for stage in stages:
            run_stage(stage, sw, progress=False)
    out = {"start": ss._evaluate(c, sw, "start", tokenizer, path=kimi_k3.start_path(c),
                                 seed=SEED, n=EVAL_N)}
    for name, stage in zip(("teacher", "full_vocab", "sampled"), stages):
        out[name] = ss._evaluate(c, sw, stage.name, tokenizer, seed=SEED, n=EVAL_N)
    return out


def _gain(runs, model, cell):
    return rp.paired(runs[model][cell]["passes"], runs["start"][cell]["passes"])


def test_grpo_raises_pass_rate(runs):
    g = _gain(runs, "teacher", GENERAL)
    assert g["diff"] > 3 * g["se"], g
    c = _gain(runs, "teacher", CODING)
    assert c["diff"] > -2 * c["se"], c


def test_full_vocab_opd_carries_the_teachers_gain(runs):
    g, t = _gain(runs, "full_vocab", GENERAL), _gain(runs, "teacher", GENERAL)
    assert g["diff"] > 3 * g["se"], g
    assert g["diff"] >= 0.5 * t["diff"], (g, t)


def test_sampled_token_opd_moves_toward_the_teacher(runs):
    g = _gain(runs, "sampled", GENERAL)
    assert g["diff"] > 3 * g["se"], g
