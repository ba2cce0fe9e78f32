"""GLM per-turn thinking (effort think_mixed): each task's schedule is drawn from its seed and
kept through JSONL, every assistant turn is opened by its mode token, and the reward checks
every turn against its mode."""
import dataclasses

import pytest

from opd_jax import envs
from opd_jax.envs import TaskSource, get_family, load_jsonl, save_jsonl
from opd_jax.envs.agent import ToolEnv, split_turns
from opd_jax.envs.data import SCHEDULE_TURNS


def _task(modes=None, family="tool_chain", i=0, split="train"):
    t = TaskSource(family, size=i + 1, seed=0, difficulty=1, effort="think_mixed",
                   split=split)[i]
    if modes is not None:
        t = dataclasses.replace(t, meta={**t.meta, "turn_modes": list(modes)})
    return t


def test_schedule_is_drawn_from_the_task_seed_and_mixes_modes():
    a = [t.meta["turn_modes"] for t in TaskSource("tool_chain", size=20, seed=3,
                                                   difficulty=2, effort="think_mixed")]
    b = [t.meta["turn_modes"] for t in TaskSource("tool_chain", size=20, seed=3,
                                                   difficulty=2, effort="think_mixed")]
    c = [t.meta["turn_modes"] for t in TaskSource("tool_chain", size=20, seed=4,
                                                   difficulty=2, effort="think_mixed")]
    assert a == b and a != c
    assert all(len(m) == SCHEDULE_TURNS and set(m) <= {"think_on", "think_off"} for m in a)
    firsts = {m[0] for m in a}
    assert firsts == {"think_on", "think_off"}          # both modes open episodes
    # The same index is the same problem under every effort; only the schedule is added.
    on = TaskSource("tool_chain", size=20, seed=3, difficulty=2, effort="think_on")
    assert [t.prompt for t in on] == [t.prompt for t in TaskSource(
        "tool_chain", size=20, seed=3, difficulty=2, effort="think_mixed")]
    assert all("turn_modes" not in t.meta for t in on)


def test_jsonl_round_trip_keeps_the_schedule(tmp_path):
    tasks = list(TaskSource("tool_lookup", size=5, seed=1, difficulty=2, effort="think_mixed"))
    path = tmp_path / "mixed.jsonl"
    assert save_jsonl(tasks, path) == 5
    back = load_jsonl(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in tasks]
    assert [envs.turn_modes(t) for t in back] == [tuple(t.meta["turn_modes"]) for t in tasks]
    assert all(envs.render_prompt(a) == envs.render_prompt(b) for a, b in zip(back, tasks))


def test_bad_schedules_and_single_turn_families_are_refused():
    with pytest.raises(ValueError, match="family 'chain' is single-turn"):
        TaskSource("chain", size=1, effort="think_mixed")
    with pytest.raises(ValueError, match=r"meta\['turn_modes'\]=\['think_on', 'maybe'\]"):
        _task(["think_on", "maybe"])
    with pytest.raises(ValueError, match=r"meta\['turn_modes'\]=None"):
        dataclasses.replace(_task(), meta={"difficulty": 1})
    with pytest.raises(ValueError, match="switched per prompt"):
        dataclasses.replace(_task(), effort="think_on")
    # with_effort drops the schedule when leaving the per-turn effort
    assert "turn_modes" not in _task().with_effort("think_on").meta
    with pytest.raises(ValueError, match="turn 3 has no thinking mode"):
        envs.turn_mode(_task(["think_on"] * 3), 3)


def test_every_turn_is_opened_by_its_mode_token():
    t = _task(["think_on", "think_off", "think_on"] + ["think_off"] * 13)
    (n1, v1), (n2, v2) = t.reference["table"].items()
    env = ToolEnv()
    assert env.reset(t).startswith("<|think_on|><|user|>")
    r1 = env.step(f"<think>{n1}</think><tool_call>lookup {n1}</tool_call>")
    assert r1.observation == f"<|tool|>{v1}<|think_off|><|assistant|>"
    r2 = env.step(f"<tool_call>lookup {n2}</tool_call>")
    assert r2.observation == f"<|tool|>{v2}<|think_on|><|assistant|>"
    # the teacher's view has no control tokens, in the prompt or in the observations
    assert env.reset(t, role="teacher").startswith("<|user|>")
    assert env.step(f"<tool_call>lookup {n1}</tool_call>").observation == \
        f"<|tool|>{v1}<|assistant|>"
    # a transcript with mode tokens in its observations splits into the same turns
    assert split_turns(f"a<|tool|>{v1}<|think_off|><|assistant|>b") == ["a", "b"]


def _episode(t, turns):
    env = ToolEnv()
    env.reset(t)
    for text in turns:
        res = env.step(text)
    assert res.done
    return res


def test_reward_checks_every_turn_against_its_mode():
    modes = ["think_on", "think_off", "think_on"] + ["think_off"] * 13
    t = _task(modes)
    (n1, v1), (n2, v2) = t.reference["table"].items()
    ans = t.reference["answer"]
    obey = [f"<think>{n1}</think><tool_call>lookup {n1}</tool_call>",
            f"<tool_call>lookup {n2}</tool_call>", f"<think>{ans}</think>{ans}"]
    res = _episode(t, obey)
    assert res.reward == 1.0 and res.info["mode_violations"] == []
    assert res.info["turn_modes"] == modes[:3]
    # an empty think span (what the sampler's forced </think> leaves) is no thinking
    assert _episode(t, [obey[0], f"<think></think>{obey[1]}", obey[2]]).reward == 1.0
    think_off = _episode(t, [obey[0], f"<think>{n2}</think>{obey[1]}", obey[2]])
    assert think_off.reward == 0.0 and think_off.info["correct"] == 1.0
    assert think_off.info["mode_violations"] == ["turn 1: thought in a think_off turn"]
    no_think = _episode(t, [obey[0], obey[1], ans])
    assert no_think.reward == 0.0
    assert no_think.info["mode_violations"] == ["turn 2: no thinking in a think_on turn"]
    # the think_on turns share the effort's budget (64 tokens)
    over = _episode(t, [obey[0], obey[1], f"<think>{'9' * 64}</think>{ans}"])
    assert over.reward == 0.0 and over.info["over_budget"]
    # the same turns as one transcript (the family reward) score the same
    text = obey[0] + f"<|tool|>{v1}<|think_off|><|assistant|>" + obey[1] + \
        f"<|tool|>{v2}<|think_on|><|assistant|>" + obey[2]
    assert envs.score(t, text).score == 1.0


@pytest.mark.parametrize("family", ["tool_chain", "tool_lookup"])
def test_demos_obey_their_schedules(family):
    tasks = list(TaskSource(family, size=24, seed=0, difficulty=3, effort="think_mixed"))
    for t in tasks:
        demo = get_family(family).demo(t)
        res = envs.score(t, demo)
        assert res.score == 1.0 and res.details["mode_violations"] == [], (t.id, demo)
        turns = split_turns(demo)
        assert [("<think>" in x and "<think></think>" not in x) for x in turns] == [
            m == "think_on" for m in t.meta["turn_modes"][:len(turns)]]
    # per-prompt demos are unchanged by the schedule machinery
    t = TaskSource(family, size=1, seed=0, difficulty=3, effort="think_off")[0]
    assert "<think>" not in get_family(family).demo(t)
