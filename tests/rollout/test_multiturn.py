"""Multi-turn driver: observations appended to the cache, masks, env protocol, log-probs."""
import numpy as np
import pytest
from rollout_fixtures import full_logits, random_model

from opd_jax.envs.base import StepResult, Task
from opd_jax.models import synthetic_tokenizer
from opd_jax.rollout import SamplingParams, engine, process_logits
from opd_jax.rollout.multiturn import run_episodes

OBS = "<|tool|>ok<|assistant|>"


class CountingEnv:
    """Three turns; the observation names the turn; reward = number of turns so far."""
    stop_strings = ("</tool_call>",)

    def __init__(self, turns):
        self.turns, self.seen = turns, []

    def reset(self, task, role="student"):
        return f"<|user|>{task.prompt}<|assistant|>"

    def step(self, text):
        self.seen.append(text)
        n = len(self.seen)
        return StepResult(OBS if n < self.turns else "", float(n), n >= self.turns, {"n": n})


def test_episodes_append_observations_and_mask_them(monkeypatch):
    tok = synthetic_tokenizer()
    model = random_model(seed=0)
    tasks = [Task(id=str(i), family="x", domain="agent", effort="low", prompt=p, reference={})
             for i, p in enumerate(["hi", "a longer prompt", "x", "yz"])]
    envs = [CountingEnv(3), CountingEnv(2), CountingEnv(1), CountingEnv(2)]
    widths = []
    extend = engine.extend

    def spy(model, state, chunk, mask, **kw):
        widths.append(chunk.shape[1])
        return extend(model, state, chunk, mask, **kw)
    monkeypatch.setattr(engine, "extend", spy)
    eps = run_episodes(model, tok, tasks, envs=envs, max_turns=5, max_new_tokens=6,
                       max_len=64, temperature=1.0, seed=0)
    assert eps.done.tolist() == [True] * 4 and eps.turns.tolist() == [3, 2, 1, 2]
    assert eps.rewards.tolist() == [3.0, 2.0, 1.0, 2.0] and eps.turn_rewards[0] == [1.0, 2.0, 3.0]
    assert widths == [32, 4, 4]  # the prompts once, then only the observations
    b = eps.batch
    obs_ids = tok.encode(OBS, add_special_tokens=False)
    for r, env in enumerate(envs):
        L = int(b.lengths_B[r])
        ids = np.asarray(b.tokens_BxL[r, :L]).tolist()
        mask = np.asarray(b.response_mask_BxL[r, :L]).astype(bool)
        prompt = tok.encode(env.reset(tasks[r]), add_special_tokens=False)
        # layout: prompt, then (turn, observation) pairs; only turns are on the mask
        assert ids[:len(prompt)] == prompt and not mask[:len(prompt)].any()
        # runs of mask 1 are the turns (ids the tokenizer lacks decode to ""), runs of 0
        # between them are the observations
        edges = np.flatnonzero(np.diff(np.r_[0, mask[len(prompt):], 0])) + len(prompt)
        runs = list(zip(edges[::2], edges[1::2]))
        assert len(runs) == len(env.seen) and runs[-1][1] == L
        for t, ((s0, s1), text) in enumerate(zip(runs, env.seen)):
            assert tok.decode(ids[s0:s1]) == text
            if t:
                assert ids[runs[t - 1][1]:s0] == obs_ids
    # sampler log-probs equal a teacher-forced forward over the whole packed episode
    logits = full_logits(model, b.tokens_BxL, b.attention_mask_BxL)
    lp = process_logits(logits.reshape(-1, logits.shape[-1]),
                        SamplingParams.create(logits.shape[0] * logits.shape[1]))
    lp = np.asarray(lp).reshape(logits.shape)
    tokens = np.asarray(b.tokens_BxL)
    target = np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=2)[..., 0]
    mask = np.asarray(b.response_mask_BxL)[:, 1:]
    np.testing.assert_allclose(np.where(mask, target, 0), np.asarray(b.sampler_logp_BxL)[:, 1:],
                               atol=1e-5)


def test_empty_prompt_is_an_error():
    class Empty(CountingEnv):
        def reset(self, task, role="student"):
            return ""
    task = Task(id="0", family="x", domain="agent", effort="low", prompt="p", reference={})
    with pytest.raises(ValueError, match="environment 0 reset to an empty prompt"):
        run_episodes(random_model(), synthetic_tokenizer(), [task], envs=[Empty(1)])
