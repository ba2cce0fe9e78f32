"""Training log-probs are on the distribution the sampler drew from (issue 17, part 3).

Rollouts at T != 1 and/or with top-k / top-p, scored the way the trainer scores them
(`build_sequences` + `batch_logprobs` with the objective's behaviour): on an unchanged model
the IcePop/TIS mismatch k_t = exp(lp_train - lp_sampler) is 1 up to fp32 numerics, while
the plain T = 1 log-probs (the old behaviour) are far from it. The OPD teacher comparison
stays on the plain T = 1 student log-probs.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from opd_jax import envs
from opd_jax.models import ModelConfig, synthetic_tokenizer
from opd_jax.episodes import SamplingConfig, play
from opd_jax.trainers.objectives import LOGP_FLOOR, Behaviour, make_objective
from opd_jax.trainers.policy import batch_logprobs
from opd_jax.episodes.sequences import build_sequences
from tests.models.helpers import random_model

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)
SETTINGS = [dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=20),
            dict(temperature=1.3, top_k=40, top_p=0.8)]


@pytest.fixture(scope="module")
def model():
    # std 0.3: peaked enough that top-p / top-k cut a real part of the vocabulary (measured:
    # max |log k| <= 4.6e-6 here, vs 0.78-0.94 with the T = 1 log-probs).
    return random_model(CFG, seed=0, std=0.3)


def _rollout(model, **knobs):
    """play() episodes (single turn, nothing forced) -> a trainer sequence batch."""
    tasks = list(envs.TaskSource("arithmetic", size=6, seed=0, effort="high"))
    sampling = SamplingConfig(max_new_tokens=16, max_turns=1, use_think_budget=False, **knobs)
    eps = play(model, synthetic_tokenizer(), tasks, sampling, seed=1)
    seqs = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                           response_masks=[e.response_mask for e in eps],
                           sampler_logps=[e.sampler_logp for e in eps])
    batch = {k: jnp.asarray(v) for k, v in seqs.items()
             if k not in ("prompt_len", "response_len")}
    return sampling, batch


def _score(model, batch, behaviour):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = jax.jit(functools.partial(batch_logprobs, graphdef=graphdef, behaviour=behaviour))
    return fn(params, rest, {k: batch[k] for k in ("inputs", "targets", "segment_ids")})


@pytest.mark.parametrize("knobs", SETTINGS)
def test_icepop_mismatch_is_one_at_the_sampling_setting(model, knobs):
    sampling, batch = _rollout(model, **knobs)
    obj = make_objective("grpo", sampling=sampling, correction="icepop")
    assert obj.behaviour == Behaviour(knobs["temperature"], knobs.get("top_k", 0),
                                      knobs.get("top_p", 1.0))
    lp = _score(model, batch, obj.behaviour)
    m = np.asarray(batch["mask"]).astype(bool)
    assert m.sum() > 50
    sampler = np.asarray(batch["sampler_logp"])[m]

    log_k = np.asarray(lp["logp"])[m] - sampler
    assert abs(np.exp(log_k).mean() - 1.0) < 1e-5, np.exp(log_k).mean()
    assert np.abs(log_k).max() < 1e-5, np.abs(log_k).max()

    # The old behaviour: plain T = 1 training log-probs fail the same check by far.
    log_k_plain = np.asarray(lp["logp_plain"])[m] - sampler
    assert abs(np.exp(log_k_plain).mean() - 1.0) > 1e-2, np.exp(log_k_plain).mean()
    assert np.abs(log_k_plain).max() > 1e-1

    # The objective scores the current policy the same way: at the first step the PPO
    # ratio and the IcePop mismatch are 1 and IcePop keeps every token.
    batch |= {"old_logp": lp["logp"], "old_logp_plain": lp["logp_plain"],
              "adv": jnp.linspace(-1.0, 1.0, batch["mask"].shape[0])}
    _, metrics = obj(model, batch)
    np.testing.assert_allclose(metrics["mismatch_mean"], 1.0, atol=1e-5)
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-5)
    assert float(metrics["icepop_masked_frac"]) == 0.0


def test_plain_and_greedy_behaviour_keep_the_t1_logprobs(model):
    _, batch = _rollout(model, temperature=1.0)
    for behaviour in (None, Behaviour(), Behaviour(temperature=0.0, top_p=0.5)):
        lp = _score(model, batch, behaviour)
        np.testing.assert_array_equal(lp["logp"], lp["logp_plain"])
    assert make_objective("grpo").behaviour.plain
    assert make_objective("grpo", sampling=SamplingConfig(temperature=0.0)).behaviour.plain
    with pytest.raises(ValueError, match="behaviour comes from the rollout sampling"):
        make_objective("grpo", sampling=SamplingConfig(), behaviour=Behaviour())


def test_tokens_outside_the_nucleus_give_finite_loss_and_grads(model):
    """Random targets (most outside the top-p set): floored log-probs, IcePop drops them,
    loss and gradients stay finite."""
    rng = np.random.default_rng(0)
    B, T = 4, 12
    batch = {"inputs": jnp.asarray(rng.integers(0, 128, (B, T)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 128, (B, T)), jnp.int32),
             "segment_ids": jnp.ones((B, T), jnp.int32), "mask": jnp.ones((B, T), jnp.int32),
             "adv": jnp.asarray([1.0, -1.0, 0.5, -0.5])}
    behaviour = Behaviour(temperature=0.7, top_p=0.5)
    lp = _score(model, batch, behaviour)
    outside = np.asarray(lp["logp"]) == LOGP_FLOOR
    assert 0 < outside.mean() < 1
    batch |= {"old_logp": lp["logp"], "old_logp_plain": lp["logp_plain"],
              "sampler_logp": jnp.where(outside, -1.0, lp["logp"])}
    obj = make_objective("grpo", sampling=dataclasses.asdict(behaviour), correction="icepop")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: obj(nnx.merge(graphdef, p, rest), batch), has_aux=True)(params)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(metrics["icepop_masked_frac"], outside.mean(), atol=1e-6)


def test_opd_teacher_comparison_stays_on_the_plain_student(model):
    sampling, batch = _rollout(model, temperature=0.7, top_p=0.9)
    lp = _score(model, batch, Behaviour.of(sampling))
    teacher = lp["logp_plain"] + 0.3 * jnp.sin(jnp.arange(batch["mask"].size, dtype=jnp.float32)
                                                .reshape(batch["mask"].shape))
    batch |= {"old_logp": lp["logp"], "old_logp_plain": lp["logp_plain"],
              "teacher_logp": teacher, "teacher_onehot": jnp.ones((batch["mask"].shape[0], 1)),
              "adv": jnp.zeros(batch["mask"].shape[0])}
    m = batch["mask"].astype(jnp.float32)
    plain_ratio = teacher - lp["logp_plain"]
    mean = lambda x: float(jnp.sum(x * m) / jnp.sum(m))  # noqa: E731

    kimi = make_objective("kimi_mopd", sampling=sampling, r_max=5.0, correction=None)
    loss, metrics = kimi(model, batch)
    # r_t = teacher - plain student; the score function is the behaviour log-prob.
    np.testing.assert_allclose(metrics["r_mean"], mean(plain_ratio), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["teacher/log_ratio"][0], mean(plain_ratio), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(loss, mean(-plain_ratio * lp["logp"]), rtol=1e-5, atol=1e-6)

    glm = make_objective("glm_cross_stage", sampling=sampling, correction="icepop")
    _, metrics = glm(model, batch)
    np.testing.assert_allclose(metrics["opd_adv_mean"], mean(plain_ratio), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(metrics["mismatch_mean"], 1.0, atol=1e-5)
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-5)
