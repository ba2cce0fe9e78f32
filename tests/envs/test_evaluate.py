"""Episode runner and effort table with scripted policies (no model needed)."""
import pytest

from opd_jax.envs import TaskSource, get_family, render_prompt
from opd_jax.envs.agent import split_turns
from opd_jax.envs.evaluate import effort_table, format_table, run_episodes
from opd_jax.envs.parsing import TOOL_CLOSE

FAMILIES = {"general": "arithmetic", "agent": "tool_lookup", "coding": "code_expr"}


def _oracle(tasks):
    """Plays each task's demo, one assistant turn per call (looked up by prompt)."""
    turns = {render_prompt(t): split_turns(get_family(t.family).demo(t)) for t in tasks}

    def policy(contexts, stops):
        out = []
        for c, stop in zip(contexts, stops):
            prompt = next(p for p in turns if c.startswith(p))
            k = c.count("<|tool|>")
            out.append(turns[prompt][k])
            if TOOL_CLOSE in out[-1]:
                assert stop == (TOOL_CLOSE,)
        return out
    return policy


def test_run_episodes_multi_and_single_turn():
    tasks = [TaskSource(f, size=3, seed=1, difficulty=2, effort="max")[i]
             for f in FAMILIES.values() for i in range(3)]
    eps = run_episodes(tasks, _oracle(tasks))
    assert all(ep.done and ep.reward == 1.0 for ep in eps), [ep.info for ep in eps]
    agent = [ep for ep in eps if ep.task.family == "tool_lookup"]
    assert all(ep.turns == 3 and ep.transcript.count("<|tool|>") == 2 for ep in agent)


def test_run_episodes_stops_a_policy_that_never_answers():
    t = TaskSource("tool_lookup", size=1)[0]
    eps = run_episodes([t], lambda cs, ss: ["<tool_call>lookup x</tool_call>"] * len(cs),
                       max_turns=2)
    assert not eps[0].done and eps[0].reward == 0.0 and "not done" in eps[0].info["error"]
    with pytest.raises(ValueError, match="returned 0 texts"):
        run_episodes([t], lambda cs, ss: [])


def test_effort_table_shape_and_penalty_ordering():
    # Oracle demos think only when the steps fit the budget; with a correct answer every
    # time, reward can only fall with the effort's length penalty.
    tasks = [TaskSource("arithmetic", size=8, seed=0, difficulty=d, effort=e, split="eval")[i]
             for d in (1, 5) for e in ("low", "high", "max") for i in range(8)]
    rows = effort_table(_oracle(tasks), {"general": "arithmetic"}, difficulties=(1, 5), n=8)
    assert len(rows) == 6 and all(r["accuracy"] == 1.0 for r in rows)
    by = {(r["difficulty"], r["effort"]): r["reward"] for r in rows}
    assert by[(1, "low")] < by[(1, "high")] < by[(1, "max")] == 1.0
    table = format_table(rows)
    assert table.splitlines()[0] == "| domain | difficulty | low | high | max |"
    assert "| general | 5 | 1.000 | 1.000 | 1.000 |" in table
