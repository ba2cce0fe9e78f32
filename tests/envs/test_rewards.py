"""Rule-based rewards, the generative judge (with a deterministic fake policy), composition."""
import pytest

from opd_jax.envs import (CompositeReward, GenerativeRewardModel, LengthReward, Task,
                          format_reward, score_batch, task_reward)


def _task(answer="42"):
    return Task("t", "arithmetic", "general", "high", "40+2=?", {"answer": answer})


@pytest.mark.parametrize("response,ok", [
    ("42", True), ("<think>40+2</think>42", True), ("<think>a</think>42<eos>", True),
    ("<think>a", False), ("x<think>a</think>42", False), ("<think>a</think><think>b</think>4",
                                                         False),
    ("<think>a</think>", False), ("<think>a</think>4<|user|>", False),
])
def test_format_reward(response, ok):
    r = format_reward(_task(), response)
    assert r.score == float(ok) and (ok or "format_error" in r.details)


def test_length_reward():
    lr = LengthReward(free_tokens=4, max_tokens=8)
    assert [lr(_task(), "x" * n).score for n in (0, 4, 6, 8, 20)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="free_tokens"):
        LengthReward(free_tokens=8, max_tokens=8)


class FakeJudge:
    """Deterministic 'policy': 9 if the reference answer appears in the response, else 2.
    Records each call's batch size."""

    def __init__(self, reply=None):
        self.calls, self.reply = [], reply

    def __call__(self, prompts):
        self.calls.append(len(prompts))
        if self.reply is not None:
            return [self.reply] * len(prompts)
        out = []
        for p in prompts:
            ref = p.split("Reference: ")[1].split("\n")[0]
            resp = p.split("Response: ")[1].split("\n")[0]
            out.append(f"<think>compare</think>Score: {9 if ref in resp else 2}")
        return out


def test_generative_judge_scores_batches_and_sees_rubric():
    fake = FakeJudge()
    judge = GenerativeRewardModel(fake, rubric="Exact sum?", batch_size=3,
                                  include_reference=True)
    prompt = judge.render(_task(), "<think>hidden</think>42")
    assert "Rubric: Exact sum?" in prompt and "Response: 42\n" in prompt
    assert "hidden" not in prompt  # the judge sees the final answer only
    tasks = [_task(str(i)) for i in range(7)]
    res = score_batch(judge, tasks, [f"{i if i % 2 else 99}" for i in range(7)])
    assert fake.calls == [3, 3, 1]
    assert [r.score for r in res] == [0.2, 0.9, 0.2, 0.9, 0.2, 0.9, 0.2]
    assert judge(_task(), "42").details["raw_score"] == 9.0


@pytest.mark.parametrize("reply,score,error", [
    ("Score: 7", 0.7, False), ("I think 3 out of 10... final 8", 0.8, False),
    ("Score: 15", 1.0, False), ("Score: -2", 0.0, False), ("no idea", 0.0, True),
    ("<think>maybe 10</think>", 0.0, True),
])
def test_judge_parsing(reply, score, error):
    r = GenerativeRewardModel(FakeJudge(reply))(_task(), "42")
    assert r.score == pytest.approx(score) and ("error" in r.details) == error


def test_judge_rejects_wrong_output_count():
    judge = GenerativeRewardModel(lambda ps: ["Score: 1"])
    with pytest.raises(ValueError, match="returned 1 texts for 2 prompts"):
        judge.batch([_task(), _task()], ["1", "2"])


def test_composite_weights_and_normalize():
    fake = FakeJudge()
    judge = GenerativeRewardModel(fake, include_reference=True)
    comp = CompositeReward({"task": task_reward, "format": format_reward, "judge": judge},
                           weights={"task": 1.0, "format": 0.5, "judge": 2.0})
    r = comp(_task(), "42")
    assert r.score == pytest.approx(1.0 + 0.5 + 2.0 * 0.9)
    assert r.details["components"]["judge"]["raw_score"] == 9.0
    wrong = comp(_task(), "<think>x")  # malformed: every part scores low
    assert wrong.score == pytest.approx(0 + 0 + 2.0 * 0.2)
    norm = CompositeReward({"task": task_reward, "format": format_reward},
                           weights={"task": 3.0, "format": 1.0}, normalize=True)
    assert norm(_task(), "41").score == pytest.approx(0.25)
    res = norm.batch([_task(), _task()], ["42", "41"])
    assert [r.score for r in res] == [1.0, 0.25]
    with pytest.raises(ValueError, match="weights keys"):
        CompositeReward({"a": format_reward}, weights={"b": 1.0})


def test_step_many_equals_stepping_one_by_one(monkeypatch):
    """Same StepResults as env.step per episode; code programs go to one sandbox batch."""
    from opd_jax.envs import TaskSource, get_family, make_env, sandbox, step_many
    tasks = (list(TaskSource("arithmetic", size=3, seed=1)) +
             list(TaskSource("code_expr", size=4, seed=1)) +
             list(TaskSource("tool_lookup", size=2, seed=1)))
    texts = ([get_family(t.family).demo(t) for t in tasks[:2]] + ["7"] +
             [get_family(t.family).demo(t) for t in tasks[3:5]] + ["print(", "1+1"] +
             ["<think>x</think>lookup(alpha)", "no call"])
    one_by_one = []
    for t, x in zip(tasks, texts):
        e = make_env(t)
        e.reset(t)
        one_by_one.append(e.step(x))
    calls = []
    run_many = sandbox.run_many
    monkeypatch.setattr(sandbox, "run_many", lambda codes, **kw: calls.append(len(codes)) or
                        run_many(codes, **kw))
    envs_ = [make_env(t) for t in tasks]
    for t, e in zip(tasks, envs_):
        e.reset(t)
    batched = step_many(envs_, texts)
    assert [(r.observation, r.reward, r.done) for r in batched] == \
        [(r.observation, r.reward, r.done) for r in one_by_one]
    assert [r.info.get("passed") for r in batched] == [r.info.get("passed") for r in one_by_one]
    assert len(calls) == 1 and calls[0] >= 3          # the parsable programs, at once
    assert sum(r.reward for r in batched[3:5]) == 2.0  # the demos pass
    with pytest.raises(RuntimeError, match="step\\(\\) before reset"):
        envs_[0].step("42")                            # single-turn: done after one step
    with pytest.raises(ValueError, match="2 environments but 1 texts"):
        step_many(envs_[:2], ["x"])
