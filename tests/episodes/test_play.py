"""The episode runner: observations appended to the live KV cache, masks, log-probs, and a
token write-ahead log from which a killed rollout resumes to the same episodes."""
import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax import envs
from opd_jax.envs.base import StepResult, Task, register_env
from opd_jax.models import ModelConfig, synthetic_tokenizer
from opd_jax.episodes import wal
from opd_jax.rollout import SamplingParams, engine, process_logits
from opd_jax.episodes import SamplingConfig, play
from tests.models.helpers import random_model

OBS = "<|tool|>ok<|assistant|>"
CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


class _Counting:
    """`turns` turns (task.reference); the observation names the turn; reward = turns so far."""
    stop_strings = ("</tool_call>",)

    def reset(self, task, role="student"):
        self.turns, self.seen = task.reference["turns"], []
        return f"<|user|>{task.prompt}<|assistant|>"

    def step(self, text):
        self.seen.append(text)
        n = len(self.seen)
        return StepResult(OBS if n < self.turns else "", float(n), n >= self.turns, {"n": n})


register_env("test_counting", _Counting)


def _tasks(turns=(3, 2, 1, 2), prompts=("hi", "a longer prompt", "x", "yz")):
    return [Task(id=str(i), family="x", domain="agent", effort="high", prompt=p,
                 reference={"turns": n}, env="test_counting")
            for i, (p, n) in enumerate(zip(prompts, turns))]


def _mixed_tasks():
    """Multi-turn rows and single-turn arithmetic rows with think budgets, in one batch."""
    arith = [dataclasses.replace(t, effort=e) for t, e in zip(
        envs.TaskSource("arithmetic", size=3, seed=0, difficulty=2), ("low", "high", "max"))]
    return _tasks() + arith


def test_observations_are_appended_to_the_cache_and_masked(monkeypatch):
    tok, model = synthetic_tokenizer(), random_model(CFG, seed=0, std=0.3)
    widths = []
    extend = engine.extend

    def spy(model, state, chunk, mask, **kw):
        widths.append(chunk.shape[1])
        return extend(model, state, chunk, mask, **kw)
    monkeypatch.setattr(engine, "extend", spy)
    tasks = _tasks()
    eps = play(model, tok, tasks, SamplingConfig(max_new_tokens=6, max_turns=5,
                                                 use_think_budget=False), seed=0)
    assert [e.done for e in eps] == [True] * 4 and [e.turns for e in eps] == [3, 2, 1, 2]
    assert [e.reward for e in eps] == [3.0, 2.0, 1.0, 2.0]
    assert widths == [32, 4, 4]    # the prompts once, then only the observations
    obs_ids = tok.encode(OBS, add_special_tokens=False)
    for ep in eps:
        mask = np.asarray(ep.response_mask, bool)
        assert len(ep.response_ids) == len(mask) == len(ep.sampler_logp)
        # runs of mask 1 are the turns, the runs of 0 between them the observations
        edges = np.flatnonzero(np.diff(np.r_[0, mask, 0]))
        runs = list(zip(edges[::2], edges[1::2]))
        assert len(runs) == ep.turns and runs[-1][1] == len(mask)
        for t in range(1, len(runs)):
            assert ep.response_ids[runs[t - 1][1]:runs[t][0]] == obs_ids
    # sampler log-probs equal a teacher-forced forward over the whole episode
    for ep in eps:
        ids = ep.prompt_ids + ep.response_ids
        logits = model(jnp.asarray([ids]))[0]
        lp = np.asarray(process_logits(logits, SamplingParams.create(len(ids))))
        target = lp[np.arange(len(ids) - 1), ids[1:]][len(ep.prompt_ids) - 1:]
        mask = np.asarray(ep.response_mask, bool)
        np.testing.assert_allclose(np.where(mask, target, 0.0), ep.sampler_logp, atol=1e-5)


def test_a_full_cache_is_reprefilled_exactly():
    """Episodes that outgrow the cache's slots are moved to a larger one mid-episode: the
    same tokens as with a cache sized for the whole episode from the start."""
    tok, model = synthetic_tokenizer(), random_model(CFG, seed=0, std=0.3)
    tasks = _tasks(turns=(8, 8, 5, 8))
    sampling = SamplingConfig(max_new_tokens=12, max_turns=8, use_think_budget=False)
    base = play(model, tok, tasks, sampling, seed=3)
    grown = {}
    from opd_jax.episodes import runner as ep_mod
    orig = ep_mod._Play.load

    def big_first(self, live, turn, extra):
        grown.setdefault("calls", []).append(turn)
        return orig(self, live, turn, extra + (1024 if turn == 0 else 0))
    ep_mod._Play.load = big_first
    try:
        big = play(model, tok, tasks, sampling, seed=3)
        n_big = len(grown["calls"])
    finally:
        ep_mod._Play.load = orig
    assert n_big == 1                                    # one cache for the whole episode
    for a, b in zip(base, big):
        assert a.response_ids == b.response_ids and a.turns == b.turns
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-5)


def _fields(e):
    return (e.prompt_ids, e.response_ids, e.response_mask, e.reward, e.turns, e.done,
            e.finish, e.text)


SAMPLING = SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.95, max_turns=4)


def test_resume_from_every_commit_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    tok, model = synthetic_tokenizer(), random_model(CFG, seed=1, std=0.3)
    tasks = _mixed_tasks()
    ref_path = str(tmp_path / "ref.wal")
    ref = play(model, tok, tasks, SAMPLING, seed=5, wal_path=ref_path, steps_per_call=3)
    _, records, _ = wal.read_log(ref_path)
    n_tokens = sum(k == wal.TOKEN for k, *_ in records)
    obs_len = len(tok.encode(OBS, add_special_tokens=False))
    observed = sum((e.turns - 1) * obs_len for e in ref if e.task.env)
    assert n_tokens == sum(len(e.response_ids) for e in ref) - observed > 0
    assert any(e.turns > 1 for e in ref) and any(not e.task.env for e in ref)
    # commits: the header, one per decode chunk, one per environment step
    commits = wal.TokenLog.commit
    plain = play(model, tok, tasks, SAMPLING, seed=5)   # no log: the same episodes
    assert [_fields(e) for e in plain] == [_fields(e) for e in ref]
    total = {"n": 0}

    def count(self):
        total["n"] += 1
        return commits(self)
    monkeypatch.setattr(wal.TokenLog, "commit", count)
    play(model, tok, tasks, SAMPLING, seed=5, wal_path=str(tmp_path / "count.wal"),
         steps_per_call=3)
    n_commits = total["n"]
    assert n_commits > 6
    for kill_after in sorted({2, 3, n_commits // 3, n_commits // 2, n_commits - 2}):
        path = str(tmp_path / f"cut{kill_after}.wal")
        calls = {"n": 0}

        def dying(self):
            calls["n"] += 1
            if calls["n"] > kill_after:
                self.buffer.clear()
                raise KeyboardInterrupt("killed")
            return commits(self)
        monkeypatch.setattr(wal.TokenLog, "commit", dying)
        with pytest.raises(KeyboardInterrupt):
            play(model, tok, tasks, SAMPLING, seed=5, wal_path=path, steps_per_call=3)
        monkeypatch.setattr(wal.TokenLog, "commit", commits)
        _, before, _ = wal.read_log(path)
        logged = [(r[1], r[2]) for r in before if r[0] == wal.TOKEN]
        stats = {}
        out = play(model, tok, tasks, SAMPLING, seed=5, wal_path=path, steps_per_call=3,
                   stats=stats)
        assert stats["resumed_tokens"] == len(logged) > 0
        assert [_fields(e) for e in out] == [_fields(e) for e in ref], kill_after
        for a, b in zip(out, ref):
            np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-5)
        # nothing logged was generated again: every (row, position) appears once
        _, after, _ = wal.read_log(path)
        positions = [(r[1], r[2]) for r in after if r[0] == wal.TOKEN]
        assert len(positions) == len(set(positions)) == n_tokens, kill_after
        assert positions[:len(logged)] == logged


def test_a_log_of_another_job_is_refused(tmp_path):
    tok, model = synthetic_tokenizer(), random_model(CFG, seed=1, std=0.3)
    path = str(tmp_path / "job.wal")
    play(model, tok, _tasks(), SAMPLING, seed=5, wal_path=path, identity={"iteration": 3})
    with pytest.raises(ValueError, match="belongs to another job"):
        play(model, tok, _tasks(), SAMPLING, seed=5, wal_path=path, identity={"iteration": 4})
    with pytest.raises(ValueError, match="belongs to another job"):
        play(model, tok, _tasks(), SAMPLING, seed=6, wal_path=path, identity={"iteration": 3})
    assert os.path.getsize(path) > 0
