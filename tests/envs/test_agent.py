"""Domain agent: generator, the multi-turn tool environment, and its final-state reward."""
import pytest

from opd_jax.envs import (KNOWN_EFFORTS, Environment, TaskSource, get_family, make_env,
                          score)
from opd_jax.envs.agent import AGENT_LEVELS, ToolEnv, safe_calc


def _task(difficulty=1, seed=0, i=0, effort="high"):
    return TaskSource("tool_lookup", size=i + 1, seed=seed, difficulty=difficulty,
                      effort=effort)[i]


def test_generator_deterministic_and_difficulty_knob():
    a = [t.to_dict() for t in TaskSource("tool_lookup", size=10, seed=3, difficulty=2)]
    b = [t.to_dict() for t in TaskSource("tool_lookup", size=10, seed=3, difficulty=2)]
    c = [t.to_dict() for t in TaskSource("tool_lookup", size=10, seed=4, difficulty=2)]
    assert a == b and a != c
    for d, (k, vmax, _) in AGENT_LEVELS.items():
        for t in TaskSource("tool_lookup", size=20, seed=0, difficulty=d):
            table = t.reference["table"]
            assert len(table) == k and max(table.values()) <= vmax
            assert all(name in t.prompt for name in table)
            assert str(table) not in t.prompt  # values stay hidden


def _play(env, turns):
    res = None
    for text in turns:
        res = env.step(text)
        if res.done:
            break
    return res


def test_correct_episode_scores_one_and_observations_carry_tool_results():
    t = _task(difficulty=1)
    env = make_env(t)
    assert isinstance(env, Environment) and env.stop_strings == ("</tool_call>",)
    prompt = env.reset(t)
    assert prompt.startswith("<|high|><|user|>Tools:") and prompt.endswith("<|assistant|>")
    assert env.reset(t, role="teacher").startswith("<|user|>")
    (n1, v1), (n2, v2) = t.reference["table"].items()
    r1 = env.step(f"<think>need {n1}</think><tool_call>lookup {n1}</tool_call>")
    assert (r1.observation, r1.done, r1.reward) == (f"<|tool|>{v1}<|assistant|>", False, 0.0)
    r2 = env.step(f"<tool_call>lookup {n2}</tool_call>")
    assert r2.observation == f"<|tool|>{v2}<|assistant|>"
    final = env.step(f"<think>{v1}+{v2}</think>{v1 + v2}")
    assert final.done and final.info["correct"] == 1.0
    assert final.reward == pytest.approx(
        1 - 0.2 * final.info["think_tokens"] / KNOWN_EFFORTS["high"].think_budget)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")


def test_wrong_answer_and_guessing_without_lookups_score_zero():
    t = _task(difficulty=1)
    env = make_env(t)
    env.reset(t)
    assert env.step("123456").reward == 0.0
    env.reset(t)  # right number, but no lookups: the final state says it was a guess
    res = env.step(t.reference["answer"])
    assert res.reward == 0.0 and res.info["missing"] == sorted(t.reference["table"])
    lenient = ToolEnv(require_lookups=False)
    lenient.reset(t)
    assert lenient.step(t.reference["answer"]).reward == 1.0


def test_bad_tool_calls_return_errors_and_max_turns_ends_episode():
    t = _task(difficulty=1)
    env = make_env(t)
    env.reset(t)
    assert "unknown tool" in env.step("<tool_call>search x</tool_call>").observation
    assert "unknown name" in env.step("<tool_call>lookup zzz</tool_call>").observation
    assert "bad expression" in env.step("<tool_call>calc __import__('os')</tool_call>").observation
    res = _play(env, ["<tool_call>calc 1+1</tool_call>"] * 10)
    assert res.done and res.reward == 0.0 and res.info["error"] == "max_turns"
    assert res.info["n_invalid"] == 3 and res.info["turns"] == len(t.reference["table"]) + 3


def test_malformed_turn_ends_with_zero():
    t = _task()
    env = make_env(t)
    env.reset(t)
    res = env.step("<think>hmm <tool_call>lookup kiwi</tool_call>")
    assert res.done and res.reward == 0.0 and res.info["error"] == "unclosed <think>"


def test_safe_calc():
    assert safe_calc("2*(3+4)-5") == 9 and safe_calc("-3*-3") == 9
    for bad in ["2**100", "1/2", "x+1", "", "9" * 30 + "*" + "9" * 30]:
        with pytest.raises(ValueError, match="calc"):
            safe_calc(bad)


@pytest.mark.parametrize("difficulty", [1, 3, 5])
@pytest.mark.parametrize("effort", ["low", "max"])
def test_demo_transcripts_score_through_the_family_reward(difficulty, effort):
    fam = get_family("tool_lookup")
    for i in range(5):
        t = _task(difficulty, seed=1, i=i, effort=effort)
        demo = fam.demo(t)
        r = score(t, demo)  # replays the transcript through a fresh env
        assert r.details["correct"] == 1.0, (t.prompt, demo, r.details)
        assert score(t, demo.replace(f"</think>{t.reference['answer']}",
                                     "</think>99999")).score == 0.0
    assert score(t, "<tool_call>lookup kiwi</tool_call>").details["error"] == \
        "episode did not finish"
