"""Issue 33 (part): an OPD iteration compiles nothing after the first (rollout, teacher
scoring, old log-probs and the train step), whatever mix of teachers an iteration routes to. The teacher fields have one slot per teacher the routing uses
(`Teachers.slots`), zeros for a teacher with no row this iteration; the glm and deepseek
objectives compiled again mid-run when the mix changed (`teacher_onehot [B, S]`, S the
teachers present)."""
import os

import numpy as np
import pytest

from opd_jax.config import load_config
from opd_jax.recipes.pipeline import CompileClock
from opd_jax.trainers import phases
from opd_jax.trainers.run_policy import train_policy
from tests.trainers.test_policy_smoke import ROOT, SMALL, _teacher

PRESETS = {"grpo": "grpo.py:tiny", "kimi_mopd": "opd.py:kimi_mopd",
           "glm_cross_stage": "opd.py:glm_cross_stage",
           "deepseek_full_vocab": "opd.py:deepseek_full_vocab",
           "topk_distill": "opd.py:topk_distill"}


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {"general": _teacher(root / "general"), "agent": _teacher(root / "agent")}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_train_step_compiles_once_whatever_the_teacher_mix(name, teachers, tmp_path,
                                                               monkeypatch):
    # Two prompts per iteration (4 samples each) from two domains: an iteration routes to
    # one teacher or to both, so the number of teachers present changes; rows of a fixed
    # length (the shapes that may change are the teacher fields').
    extra = ["--config.rollout.prompts_per_step=2", "--config.rollout.group_size=4",
             "--config.rollout.seq_len=64", "--config.rollout.sampling.max_turns=1",
             "--config.train.steps=6", "--config.eval.every=0", "--config.eval.n=1",
             # the first checkpoint write compiles its own small programs once (slices,
             # digests, Orbax staging): only the final one, after the last iteration
             "--config.train.ckpt_every=100",
             "--config.tasks.families={'general': 'arithmetic', 'agent': 'tool_lookup'}"]
    if name != "grpo":
        extra += ["--config.teachers.routing=domain",
                  f"--config.teachers.paths={teachers!r}"]
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs", PRESETS[name]), SMALL + extra)
    compiles, ends, mixes = [], [], []
    real = phases.Updater.__call__
    run_clock = CompileClock()

    def counted(self, batch, scores, it):
        if "teacher_onehot" in scores.fields:
            mixes.append(tuple(np.asarray(scores.fields["teacher_onehot"]).sum(0) > 0))
        with CompileClock() as clock:
            out = real(self, batch, scores, it)
        compiles.append(clock.compiles)
        ends.append(run_clock.compiles)   # the whole run's count at this iteration's end
        return out
    monkeypatch.setattr(phases.Updater, "__call__", counted)
    with run_clock:
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert len(compiles) == 6 and compiles[0] >= 1
    assert compiles[1:] == [0] * 5, f"{name}: update-step compiles per iteration {compiles}"
    # the whole iteration (rollout, teacher scoring, old log-probs, update) after the first
    per_iteration = np.diff(ends).tolist()
    assert per_iteration == [0] * 5, f"{name}: compiles in iterations 2-6 {per_iteration}"
    if name != "grpo":
        present = {sum(m) for m in mixes}
        assert present == {1, 2}, f"{name}: the number of teachers never changed: {mixes}"


def _episodes(lengths, prompt=8):
    from opd_jax import envs                    # lazy: only these tests build episodes
    from opd_jax.episodes.episode import Episode  # lazy: as above
    task = envs.Task(id="t0", family="arithmetic", domain="general", effort="max",
                     prompt="p", reference={})
    return [Episode(task, list(range(1, prompt + 1)), list(range(n - prompt)), [1] * (n - prompt),
                    [0.0] * (n - prompt)) for n in lengths]


def test_rows_keep_the_longest_length_so_far_and_a_resumed_run_the_saved_one():
    # Each new row length is a new program for teacher scoring, old log-probs and the train
    # step: the batcher pads to the run's longest bucket so far (grow-only), so a run
    # compiles again only when a batch outgrows every earlier one.
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs", PRESETS["kimi_mopd"]), SMALL)
    assert not cfg.rollout.seq_len                       # the default: lengths from the rows
    batcher = phases.Batcher(cfg, None)
    Ts = []
    for lengths in ([30, 70], [40, 20], [100, 9], [50]):
        batcher.model_config = type("M", (), {"max_position_embeddings": 4096})()
        seqs, batch, _ = batcher(_episodes(lengths))
        Ts.append(seqs["inputs"].shape[1])
        assert batch["mask"].shape[1] == Ts[-1]
    assert Ts == [80, 80, 112, 112] and batcher.row_len == 112
    resumed = phases.Batcher(cfg, batcher.model_config, row_len=112)
    assert resumed(_episodes([20]))[0]["inputs"].shape[1] == 112
    fixed = load_config(os.path.join(ROOT, "opd_jax/configs", PRESETS["kimi_mopd"]),
                        SMALL + ["--config.rollout.seq_len=128"])
    assert phases.Batcher(fixed, batcher.model_config)(_episodes([20]))[0]["inputs"].shape[1] == 128
