"""Task protocol, prompt rendering, registries, grain sources and JSONL round trips."""
import json
import pickle
import subprocess
import sys

import grain
import pytest

from opd_jax.envs import (DEFAULT_EFFORTS, EffortSpec, JsonlSource, MixtureSource,
                          SingleTurnEnv, Task, TaskFamily, TaskSource, get_family,
                          grid_source, load_jsonl, make_env, register_family, render_prompt,
                          save_jsonl)
from opd_jax.envs.base import RewardResult
from opd_jax.envs.parsing import count_tokens, parse_response


def test_importing_envs_does_not_import_jax():
    code = "import sys, opd_jax.envs; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_task_validation_errors_name_the_value():
    ok = dict(id="a", family="arithmetic", domain="general", effort="low", prompt="1+1=?",
              reference={"answer": "2"})
    Task(**ok)
    for bad, msg in [({"domain": "vision"}, "domain='vision'"), ({"effort": "mid"},
                     "effort='mid'"), ({"prompt": ""}, "non-empty"),
                     ({"prompt": "caf\u00e9"}, "not ASCII"), ({"reference": [1]}, "dict")]:
        with pytest.raises(ValueError, match=msg):
            Task(**{**ok, **bad})
    with pytest.raises(ValueError, match="lacks keys"):
        Task.from_dict({"id": "x", "prompt": "p"})
    with pytest.raises(ValueError, match="unknown keys"):
        Task.from_dict({**ok, "answer": 3})
    with pytest.raises(ValueError, match="think_budget=-1"):
        EffortSpec("low", "<|low|>", -1, 0.1)


def test_render_prompt_student_has_control_token_teacher_not():
    t = TaskSource("arithmetic", size=1, effort="max")[0]
    s, te = render_prompt(t, "student"), render_prompt(t, "teacher")
    assert s == "<|max|>" + te and te == f"<|user|>{t.prompt}<|assistant|>"
    assert {e.control_token for e in DEFAULT_EFFORTS.values()} == {"<|low|>", "<|high|>",
                                                                    "<|max|>"}
    assert [DEFAULT_EFFORTS[e].think_budget for e in ("low", "high", "max")] == sorted(
        DEFAULT_EFFORTS[e].think_budget for e in DEFAULT_EFFORTS)
    with pytest.raises(ValueError, match="role='judge'"):
        render_prompt(t, "judge")
    assert all(count_tokens(render_prompt(x)) <= 128 for x in
               TaskSource("code_expr", size=30, difficulty=5))  # short for tiny models


def test_single_turn_env_protocol():
    t = TaskSource("arithmetic", size=1, seed=5)[0]
    env = make_env(t)
    assert isinstance(env, SingleTurnEnv) and env.stop_strings == ()
    assert env.reset(t) == render_prompt(t)
    res = env.step(t.reference["answer"])
    assert res.done and res.reward == 1.0 and res.observation == ""
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        make_env(Task("x", "arithmetic", "general", "low", "p", {}, env="nope"))


def test_parse_response_and_token_counts():
    assert count_tokens("<think>ab</think>") == 4 and count_tokens("<|low|>12") == 3
    p = parse_response("<think>a</think>x<think>b</think> 5 <eos>")
    assert (p.think, p.answer, p.n_think_blocks, p.stray_text) == ("ab", "5", 2, True)


def test_register_custom_family():
    fam = TaskFamily("echo_word", "general", lambda rng, d: (f"say {d}", {"w": str(d)}),
                     lambda t, r: RewardResult(float(r.strip() == t.reference["w"])),
                     max_difficulty=2)
    register_family(fam)
    register_family(fam)  # idempotent for the same object
    with pytest.raises(ValueError, match="already registered"):
        register_family(TaskFamily("echo_word", "general", None, fam.reward))
    t = TaskSource("echo_word", size=2, difficulty=2)[1]
    assert make_env(t).reset(t).endswith("say 2<|assistant|>")
    with pytest.raises(KeyError, match="unknown task family 'nope'"):
        get_family("nope")


def test_task_source_works_as_grain_source_and_is_deterministic():
    src = TaskSource("algebra", size=40, seed=3, difficulty=2, effort="low")
    assert isinstance(src, grain.sources.RandomAccessDataSource)
    ds = grain.MapDataset.source(src).shuffle(seed=1).batch(8, batch_fn=list)
    first = [t.id for t in ds[0]]
    again = grain.MapDataset.source(TaskSource("algebra", size=40, seed=3, difficulty=2,
                                               effort="low")).shuffle(seed=1)
    assert first == [again[i].id for i in range(8)]
    assert sorted(t.id for b in ds for t in b) == sorted(t.id for t in src)
    assert "seed=3" in repr(src)
    assert pickle.loads(pickle.dumps(src))[5] == src[5]  # grain workers get a pickled copy
    with pytest.raises(IndexError):
        src[40]


def test_grid_source_mixes_domain_effort_cells():
    grid = grid_source({"general": "arithmetic", "agent": "tool_lookup",
                        "coding": "code_expr"}, size=4)
    cells = {(t.domain, t.effort) for t in (grid[i] for i in range(len(grid)))}
    assert len(grid) == 36 and len(cells) == 9
    with pytest.raises(ValueError, match="domain 'general', not 'coding'"):
        grid_source({"coding": "arithmetic"}, size=2)
    with pytest.raises(ValueError, match="at least one"):
        MixtureSource([])


def test_jsonl_round_trip_keeps_cell_overrides(tmp_path):
    spec = EffortSpec("high", "<|high|>", think_budget=32, length_penalty=0.3)
    tasks = [t for t in TaskSource("tool_lookup", size=5, seed=1, effort=spec)]
    path = tmp_path / "tasks.jsonl"
    assert save_jsonl(tasks, path) == 5
    back = load_jsonl(path)
    assert back == tasks and back[0].meta["effort_spec"]["think_budget"] == 32
    assert len(set(back + tasks)) == 5  # hashable, and equal tasks hash equal
    assert len(JsonlSource(path)) == 5 and JsonlSource(path)[2] == tasks[2]


def test_jsonl_user_tasks_and_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    rec = {"family": "math_answer", "domain": "general", "effort": "max",
           "prompt": "1/4 + 1/4 = ?", "reference": {"answer": "\\frac{1}{2}"}}
    path.write_text(json.dumps(rec) + "\n\n" + json.dumps({**rec, "id": "own"}) + "\n")
    t1, t2 = load_jsonl(path)
    assert (t1.id, t2.id) == ("mine-1", "own")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rec) + "\n{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        load_jsonl(bad)
    bad.write_text(json.dumps({**rec, "family": "nope"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: .*unknown task family"):
        load_jsonl(bad)
