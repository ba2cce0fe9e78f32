"""Chat families (natural-language prompts for real chat models): demos, verifiers, ChatML,
the chat effort, and the checks that keep them off the synthetic format."""
import json

import pytest

from opd_jax import envs
from opd_jax.envs.chat import final_number, parse_call
from opd_jax.models import bos_ids, resolve_tokenizer, synthetic_tokenizer

CHAT = ("word_arith", "json_call")


@pytest.mark.parametrize("family", CHAT)
@pytest.mark.parametrize("difficulty", [1, 2, 3, 5])
def test_demos_pass_and_a_wrong_answer_fails(family, difficulty):
    for task in envs.TaskSource(family, size=40, seed=3, difficulty=difficulty):
        assert task.effort == "chat" and task.split == "train"
        demo = envs.get_family(family).demo(task)
        assert envs.score(task, demo).score == 1.0, (task.prompt, demo)
        if family == "word_arith":
            wrong = demo.replace(f"Answer: {task.reference['answer']}",
                                 f"Answer: {int(task.reference['answer']) + 1}")
        else:
            call = json.loads(demo)
            key = next(iter(call["arguments"]))
            call["arguments"][key] = "nowhere"
            wrong = json.dumps(call)
        assert envs.score(task, wrong).score == 0.0


def test_word_arith_amounts_follow_the_story():
    # Replaying the demo's lines gives the answer: every step is an operation on the total.
    for task in envs.TaskSource("word_arith", size=50, seed=1, difficulty=4):
        lines = task.reference["demo"].splitlines()
        total = int(lines[0].split()[3])
        for line in lines[1:-1]:
            expr = line.rsplit(": ", 1)[-1].rstrip(".").split(". ")[-1]
            lhs, rhs = expr.split(" = ")
            a, op, b = lhs.split()
            assert int(a) == total
            total = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert total == int(rhs) and total >= 1
        assert str(total) == task.reference["answer"]


def test_final_number_and_parse_call():
    assert final_number("So 3 + 4 = 7.\nAnswer: 7") == "7"
    assert final_number("Answer: 12, then 5 more gives 17") == "12"   # the last Answer: wins
    assert final_number("He has 1,204 marbles now.") == "1204"
    assert final_number("no numbers") is None
    assert parse_call('```json\n{"name": "f", "arguments": {"a": 1}}\n```') == {
        "name": "f", "arguments": {"a": 1}}
    assert parse_call("call {bad json} then {\"name\": \"g\"}") == {"name": "g"}
    assert parse_call("[1, 2]") is None


def test_json_call_accepts_digit_strings_and_refuses_extra_arguments():
    task = envs.TaskSource("json_call", size=1, seed=0, difficulty=2)[0]
    want = json.loads(task.reference["answer"])
    as_str = {"name": want["name"],
              "arguments": {k: str(v) for k, v in want["arguments"].items()}}
    assert envs.score(task, json.dumps(as_str)).score == 1.0
    extra = {"name": want["name"], "arguments": {**want["arguments"], "extra": 1}}
    assert envs.score(task, json.dumps(extra)).score == 0.0
    assert envs.score(task, "I would call the tool.").score == 0.0


def test_chat_prompts_are_chatml_for_both_roles():
    task = envs.TaskSource("word_arith", size=1)[0]
    text = envs.render_prompt(task)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{task.prompt}<|im_end|>\n" in text
    assert envs.render_prompt(task, role="teacher") == text


def test_chat_effort_belongs_to_chat_families_only():
    with pytest.raises(ValueError, match="word_arith is a chat family.*effort='high'"):
        envs.TaskSource("word_arith", size=1, effort="high")
    with pytest.raises(ValueError, match="effort='chat' is for chat families.*'chain'"):
        envs.TaskSource("chain", size=1, effort="chat")
    task = envs.TaskSource("chain", size=1)[0]
    with pytest.raises(ValueError, match="is not a chat family"):
        envs.render_prompt(task.with_effort("chat"))
    assert envs.effort_spec(envs.TaskSource("json_call", size=1)[0]).think_budget is None


def test_synthetic_tokenizer_is_refused_for_chat_families():
    tok = synthetic_tokenizer()
    envs.check_chat_template(tok, ["chain", "tool_chain"])      # not chat families: fine
    with pytest.raises(ValueError, match="family 'json_call' renders ChatML"):
        envs.check_chat_template(tok, ["chain", "json_call"])


def test_chat_families_stay_out_of_the_base_corpus():
    from opd_jax.data.corpus import corpus_families
    assert not set(CHAT) & set(corpus_families())


def test_bos_rule_of_the_synthetic_tokenizer():
    tok = synthetic_tokenizer()
    assert bos_ids(tok) == [tok.bos_token_id]     # its template opens with <|user|>


def test_tokenizer_comes_from_init_from_unless_named(tmp_path):
    from opd_jax.models import ModelConfig, save_pretrained
    from tests.models.helpers import random_model
    assert resolve_tokenizer("synthetic", "") == "synthetic"
    assert resolve_tokenizer("", "builtin:base") == "synthetic"     # the shipped base's
    with pytest.raises(ValueError, match="model.init_from is empty"):
        resolve_tokenizer("", "")
    bare = tmp_path / "bare"        # an HF folder without tokenizer files names none
    save_pretrained(random_model(ModelConfig.preset("tiny")), str(bare))
    with pytest.raises(ValueError, match=f"init_from='{bare}', which records none"):
        resolve_tokenizer("", str(bare))
    synthetic_tokenizer().save_pretrained(str(bare))
    assert resolve_tokenizer("", str(bare)) == str(bare)


def test_json_call_problem_is_the_call_whatever_the_request_order():
    # Two requests naming the same arguments in another order are one problem: one split.
    fam = envs.get_family("json_call")
    seen: dict[str, set] = {}
    for task in envs.TaskSource("json_call", size=400, seed=0, difficulty=3):
        seen.setdefault(task.reference["answer"], set()).add(task.prompt)
    reordered = [(call, prompts) for call, prompts in seen.items() if len(prompts) > 1]
    assert reordered, "expected some call drawn with two request orders"
    for call, prompts in reordered:
        assert {fam.canonical_form(p, {"answer": call}) for p in prompts} == {call}
        assert len({envs.data.split_of("json_call", p, {"answer": call})
                    for p in prompts}) == 1
