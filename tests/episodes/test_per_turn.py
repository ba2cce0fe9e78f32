"""Per-turn thinking through the episode runner: a scripted policy (`ScriptedPolicy`, a tiny
model whose logits are overridden to write a fixed transcript) plays think_mixed episodes
on the real engine. The context holds each turn's mode token, the forced </think> budget
follows each turn's mode, and the reward follows whether every turn obeyed its mode."""
import dataclasses

import pytest

from opd_jax import envs
from opd_jax.envs.agent import ToolEnv
from opd_jax.models import ModelConfig, synthetic_tokenizer
from opd_jax.episodes import SamplingConfig, play
from tests.models.helpers import ScriptedPolicy, random_model, script_rows

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)
ON, OFF = "think_on", "think_off"


def _task(modes, i):
    t = envs.TaskSource("tool_chain", size=i + 1, seed=0, difficulty=1,
                        effort="think_mixed")[i]
    return dataclasses.replace(t, meta={**t.meta, "turn_modes": modes + [OFF] * 14})


def _transcript(task, turns):
    """The full text the policy should see and write: prompt, turns, observations."""
    env = ToolEnv()
    text = env.reset(task)
    for turn in turns:
        text += turn + env.step(turn).observation
    return text


def _rows():
    """(task, turns) per row: every schedule alternates modes; row 2 disobeys turn 0."""
    out = []
    for i, (modes, style) in enumerate([([ON, OFF, ON], "obey"), ([OFF, ON, OFF], "obey"),
                                        ([ON, OFF, ON], "skip_think")]):
        t = _task(modes, i)
        (n1, _), (n2, _) = t.reference["table"].items()
        ans = t.reference["answer"]
        think = lambda turn, note: (f"<think>{note}</think>"  # noqa: E731
                                    if modes[turn] == ON else "")
        first = "" if style == "skip_think" else think(0, n1)
        # a think_off last turn opens <think>: the engine must close it at once (budget 0)
        last = think(2, ans) if modes[2] == ON else "<think></think>"
        out.append((t, [f"{first}<tool_call>lookup {n1}</tool_call>",
                        f"{think(1, n2)}<tool_call>lookup {n2}</tool_call>",
                        f"{last}{ans}<eos>"]))
    return out


@pytest.fixture(scope="module")
def played():
    tok = synthetic_tokenizer()
    rows = _rows()
    texts = ["<bos>" + _transcript(t, turns) for t, turns in rows]
    ids = [tok.encode(x, add_special_tokens=False) for x in texts]
    model = ScriptedPolicy(random_model(CFG, seed=0), script_rows(ids))
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.0, max_turns=4)
    eps = play(model, tok, [t for t, _ in rows], sampling, seed=0)
    return tok, rows, texts, eps, model, sampling


def test_context_holds_every_turns_mode_token(played):
    tok, rows, texts, eps, _, _ = played
    for (t, _), text, ep in zip(rows, texts, eps):
        got = tok.decode(ep.prompt_ids + ep.response_ids, skip_special_tokens=False)
        assert got == text.replace("<eos>", "") + "<eos>" * got.endswith("<eos>")
        modes = t.meta["turn_modes"]
        assert got.startswith(f"<bos><|{modes[0]}|><|user|>")
        # the observations before turns 1 and 2 carry those turns' modes
        obs = [o.split("<|assistant|>")[0] for o in got.split("<|tool|>")[1:]]
        assert [o[o.index("<|"):] for o in obs] == [f"<|{modes[1]}|>", f"<|{modes[2]}|>"]
        # mode tokens are context, never trained: mask 0 wherever they sit
        ctrl = {tok.convert_tokens_to_ids(f"<|{m}|>") for m in (ON, OFF)}
        assert all(m == 0 for i, m in zip(ep.response_ids, ep.response_mask) if i in ctrl)
        assert ep.turns == 3 and ep.done


def test_forced_think_close_follows_each_turns_mode(played):
    tok, rows, _, eps, _, _ = played
    close, tool = tok.convert_tokens_to_ids("</think>"), tok.convert_tokens_to_ids("<|tool|>")
    for b, ((t, turns), ep) in enumerate(zip(rows, eps)):
        # (turn, mask) of every </think>: the turn is the number of observations before it
        got, turn = [], 0
        for i, m in zip(ep.response_ids, ep.response_mask):
            turn += i == tool
            if i == close:
                got.append((turn, m))
        # think_on turns close their own thinking (sampled, mask 1); the think_off turn's
        # opened <think> is closed by the sampler at once (forced, mask 0)
        modes = t.meta["turn_modes"]
        want = [(k, 1 if modes[k] == ON else 0) for k, text in enumerate(turns)
                if "<think>" in text]
        assert got == want, (b, got, want)
        assert any(m == 0 for _, m in want) == (modes[2] == OFF)


def test_reward_follows_obedience(played):
    _, rows, _, eps, _, _ = played
    assert [ep.reward for ep in eps] == [1.0, 1.0, 0.0]
    assert [ep.info["correct"] for ep in eps] == [1.0, 1.0, 1.0]
    assert [ep.info["mode_violations"] for ep in eps] == [
        [], [], ["turn 0: no thinking in a think_on turn"]]


def test_token_log_replays_per_turn_episodes(played, tmp_path):
    tok, rows, _, eps, model, sampling = played
    log = str(tmp_path / "mixed.wal")
    first = play(model, tok, [t for t, _ in rows], sampling, seed=0, wal_path=log,
                 steps_per_call=4)
    stats = {}
    again = play(model, tok, [t for t, _ in rows], sampling, seed=0, wal_path=log,
                 steps_per_call=4, stats=stats)
    assert stats["resumed_tokens"] > 0
    for a, b, c in zip(eps, first, again):
        assert a.response_ids == b.response_ids == c.response_ids
        assert a.response_mask == b.response_mask == c.response_mask
        assert a.reward == b.reward == c.reward


def test_a_schedule_shorter_than_max_turns_fails_before_sampling(played):
    tok, rows, _, _, model, _ = played
    t = rows[0][0]
    short = dataclasses.replace(t, meta={**t.meta, "turn_modes": [ON, OFF]})
    with pytest.raises(ValueError, match="has 2 turns but max_turns=4"):
        play(model, tok, [short], SamplingConfig(max_new_tokens=8, max_turns=4), seed=0)
