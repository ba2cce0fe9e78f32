import json

import numpy as np
import pytest

from opd_jax.data.sft import make_sft_dataset, read_jsonl, tokenize_example
from opd_jax.data.synthetic import synthetic_examples


class CharTok:
    """A stand-in tokenizer: one id per character, bos=1, eos=2."""
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def encode(self, s, add_special_tokens=False):
        return [ord(c) for c in s]


def test_tokenize_masks_response_and_spans():
    ex = {"prompt": "ab", "response": [{"text": "cd"}, {"text": "XY", "train": False},
                                       {"text": "e"}]}
    out = tokenize_example(ex, CharTok())
    assert out["tokens"].tolist() == [1, 97, 98, 99, 100, 88, 89, 101, 2]
    assert out["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]


def test_padded_batches_shift_and_mask():
    exs = [{"prompt": "1+1=", "response": "2"}] * 4
    b = next(iter(make_sft_dataset(exs, CharTok(), seq_len=8, batch_size=2)))
    assert b["inputs"].shape == (2, 8) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][0, 1:6], b["targets"][0, :5])
    # Targets '2' and eos are trained, nothing else.
    assert b["mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert b["segment_ids"][0].tolist() == [1] * 7 + [0]   # bos ... eos are real inputs


def test_packing_keeps_segments_apart():
    exs = [{"prompt": "p" * (i % 3 + 1), "response": "r"} for i in range(12)]
    b = next(iter(make_sft_dataset(exs, CharTok(), seq_len=16, batch_size=2, packing=True)))
    seg, pos, mask = b["segment_ids"][0], b["positions"][0], b["mask"][0]
    assert seg.max() >= 2                                    # several examples in one row
    for s in range(1, seg.max() + 1):
        idx = np.nonzero(seg == s)[0]
        assert pos[idx].tolist() == list(range(len(idx)))    # positions restart per segment
    assert mask[seg == 0].sum() == 0


def test_deterministic_shuffle_and_resume_state():
    exs = synthetic_examples(num_examples=50, seed=1)
    ds = make_sft_dataset(exs, CharTok(), seq_len=16, batch_size=4, seed=7)
    it = iter(ds)
    [next(it) for _ in range(3)]
    state = it.get_state()
    expect = [next(it)["inputs"] for _ in range(20)]          # crosses an epoch boundary
    it2 = iter(make_sft_dataset(exs, CharTok(), seq_len=16, batch_size=4, seed=7))
    it2.set_state(state)
    for e in expect:
        np.testing.assert_array_equal(next(it2)["inputs"], e)
    other = next(iter(make_sft_dataset(exs, CharTok(), seq_len=16, batch_size=4, seed=8)))
    assert not np.array_equal(other["inputs"], next(iter(ds))["inputs"])


def test_bad_data(tmp_path):
    with pytest.raises(ValueError, match="batch_size 8 is larger than the data \\(3 examples\\)"):
        make_sft_dataset([{"prompt": "a", "response": "b"}] * 3, CharTok(), seq_len=8,
                         batch_size=8)
    with pytest.raises(ValueError, match="needs 'prompt' and 'response' or 'messages'"):
        tokenize_example({"text": "x"}, CharTok())
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n{oops\n")
    with pytest.raises(ValueError, match="d.jsonl:2: invalid JSON"):
        read_jsonl(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_synthetic_task():
    a = synthetic_examples(num_examples=5, seed=0)
    assert a == synthetic_examples(num_examples=5, seed=0)
    assert a != synthetic_examples(num_examples=5, seed=1)
    for ex in a:
        x, y = ex["prompt"].removeprefix("<|user|>").removesuffix("<|assistant|>").split("+")
        assert int(ex["response"]) == int(x) + int(y)
    with pytest.raises(ValueError, match="unknown synthetic task 'mul'"):
        synthetic_examples("mul")
