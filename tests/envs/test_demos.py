"""Environments played by scripted policies (no model): the oracle demos solve every family
through the multi-turn protocol, and reward falls only with the effort's length penalty."""
from opd_jax.envs import TaskSource, get_family, make_env
from opd_jax.envs.agent import split_turns
from opd_jax.envs.parsing import TOOL_CLOSE
from opd_jax.envs.rewards import step_many

FAMILIES = {"general": "arithmetic", "agent": "tool_lookup", "coding": "code_expr"}


def _play_demo(tasks, max_turns=16):
    """Each task's demo, one assistant turn per step, through its environment."""
    envs = [make_env(t) for t in tasks]
    for e, t in zip(envs, tasks):
        e.reset(t)
    turns = [split_turns(get_family(t.family).demo(t)) for t in tasks]
    out = [dict(reward=0.0, done=False, turns=0, transcript="") for _ in tasks]
    for k in range(max_turns):
        live = [i for i, o in enumerate(out) if not o["done"]]
        if not live:
            break
        texts = [turns[i][k] for i in live]
        for i, text in zip(live, texts):
            if TOOL_CLOSE in text:
                assert envs[i].stop_strings == (TOOL_CLOSE,)
        for i, text, res in zip(live, texts, step_many([envs[i] for i in live], texts)):
            o = out[i]
            o["transcript"] += text + res.observation
            o["turns"] += 1
            o.update(reward=res.reward, info=res.info, done=res.done)
    return out


def test_demos_solve_multi_and_single_turn_families():
    tasks = [TaskSource(f, size=3, seed=1, difficulty=2, effort="max")[i]
             for f in FAMILIES.values() for i in range(3)]
    out = _play_demo(tasks)
    assert all(o["done"] and o["reward"] == 1.0 for o in out), [o.get("info") for o in out]
    agent = [o for t, o in zip(tasks, out) if t.family == "tool_lookup"]
    assert all(o["turns"] == 3 and o["transcript"].count("<|tool|>") == 2 for o in agent)


def test_demo_reward_falls_only_with_the_effort_penalty():
    # Oracle demos think only when the steps fit the budget; with a correct answer every
    # time, reward can only fall with the effort's length penalty.
    by = {}
    for d in (1, 5):
        for e in ("low", "high", "max"):
            tasks = list(TaskSource("arithmetic", size=8, seed=0, difficulty=d, effort=e,
                                    split="eval"))
            out = _play_demo(tasks)
            assert all(o["info"].get("correct") == 1.0 for o in out), (d, e)
            by[(d, e)] = sum(o["reward"] for o in out) / len(out)
    assert by[(1, "low")] < by[(1, "high")] < by[(1, "max")] == 1.0
