"""A teacher with another tokenizer (`opd_jax.teachers.cross_tokenizer`): character spans,
the teacher's log-probs carried back to the student's tokens (exact where the boundaries
agree, sums preserved where they do not), and equal tokenizers giving the plain values."""
from __future__ import annotations

import numpy as np
import pytest

from opd_jax.models import synthetic_tokenizer
from opd_jax.teachers.cross_tokenizer import (align_assign, align_logprobs, char_spans,
                                              cut_response, gather_values, map_response,
                                              one_to_one, retokenize)

TOK = synthetic_tokenizer()


class Words:
    """A toy coarser tokenizer: one id per run of letters, digits, or any other character."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        import re
        return [self.vocab.setdefault(p, len(self.vocab))
                for p in re.findall(r"[A-Za-z]+|[0-9]+|.", text, re.S)]

    def decode(self, ids):
        inv = {v: k for k, v in self.vocab.items()}
        return "".join(inv[i] for i in ids)


def test_char_spans_tile_the_text():
    ids = TOK.encode("12 + 30 = 42")
    text, spans = char_spans(TOK, ids)
    assert text == "12 + 30 = 42" and spans[0] == (0, 1) and spans[-1] == (11, 12)
    assert all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:]))


def test_equal_tokenizers_give_the_teachers_own_values():
    text = "x = 7; y = x + 35"
    ids, spans = retokenize(TOK, text)
    lp = -np.random.default_rng(0).random(len(ids))
    vals, exact = align_logprobs(spans, spans, lp)
    np.testing.assert_array_equal(vals, lp)
    assert exact.all()


def test_a_finer_teacher_is_exact_and_sums_its_characters():
    """Character-level teacher, word-level student: each student token's value is the sum
    of its characters' log-probs, and every token is exact."""
    text = "total = 12 + 30"
    words = Words()
    s_ids = words.encode(text)
    _, s_spans = char_spans(words, s_ids)
    t_ids, t_spans = retokenize(TOK, text)
    lp = -np.random.default_rng(1).random(len(t_ids))
    vals, exact = align_logprobs(s_spans, t_spans, lp)
    want = [sum(lp[c] for c in range(a, b)) for a, b in s_spans]
    np.testing.assert_allclose(vals, want, rtol=1e-12)
    assert exact.all() and len(s_ids) < len(t_ids)


def test_a_straddling_teacher_token_goes_where_it_ends_and_stretch_sums_are_kept():
    s_spans = [(0, 3), (3, 6), (6, 8)]
    t_spans = [(0, 2), (2, 4), (4, 6), (6, 8)]
    lp = np.array([-1.0, -2.0, -3.0, -4.0])
    vals, exact = align_logprobs(s_spans, t_spans, lp)
    np.testing.assert_allclose(vals, [-1.0, -5.0, -4.0])
    assert exact.tolist() == [False, False, True]
    assert vals[:2].sum() == lp[:3].sum()               # the stretch [0, 6) is exact
    masked, _ = align_logprobs(s_spans, t_spans, lp, exact_only=True)
    assert np.isnan(masked[:2]).all() and masked[2] == -4.0


def test_a_token_with_no_text_has_no_value():
    vals, exact = align_logprobs([(0, 2), (2, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)],
                                 [-1.0, -1.0, -1.0])
    assert np.isnan(vals[1]) and not exact[1] and vals[0] == -2.0


# -- an OPD step with a teacher of another tokenizer ---------------------------------------------
def _opd(tmp_path, name, paths, tokenizers=None, extra=()):
    import os
    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    from tests.trainers.test_policy_smoke import ROOT, SMALL
    small = [o for o in SMALL if not o.startswith("--config.model.")] if extra else SMALL
    over = small + ["--config.train.steps=1", f"--config.teachers.paths={paths!r}", *extra]
    if tokenizers:
        over.append(f"--config.teachers.tokenizers={tokenizers!r}")
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"), over)
    return train_policy(cfg, str(tmp_path / name), progress=False)["history"][0]


def test_the_cross_tokenizer_path_with_equal_tokenizers_is_the_plain_path(tmp_path):
    """The shipped base as the student (its rollouts are text, specials and EOS, as a
    trained model's are; a random model also samples the padding rows past the tokenizer,
    which have no text and are masked), a random teacher: the cross path's values are the
    plain path's, so the step is."""
    from tests.trainers.test_policy_smoke import _teacher
    t = _teacher(tmp_path / "t", seed=4)
    base = ["--config.model.init_from=builtin:base", "--config.tasks.difficulty=1",
            "--config.rollout.sampling.max_new_tokens=48"]
    plain = _opd(tmp_path, "plain", {"general/high": t}, extra=base)
    cross = _opd(tmp_path, "cross", {"general/high": t}, {"general/high": "synthetic"},
                 extra=base)
    assert cross["teachers/missing_frac"] == 0.0 and cross["teachers/cross_exact_frac"] == 1.0
    for name in ("loss", "grad_norm", "teacher/general/high/log_ratio",
                 "teacher/general/high/tokens"):
        np.testing.assert_allclose(cross[name], plain[name], rtol=1e-5, atol=1e-7,
                                   err_msg=name)


@pytest.mark.slow
def test_a_teacher_with_the_qwen_tokenizer_scores_a_synthetic_student(tmp_path):
    """A teacher whose tokenizer is Qwen's BPE (151k ids) scores a char-level student: the
    student's text is re-tokenized for it, and its log-probs come back per student token
    (char-level student, coarser teacher: tokens a teacher token straddles are not exact;
    those with no value are masked and counted)."""
    from opd_jax.models import ModelConfig, build_qwen_tokenizer, load_tokenizer, save_pretrained
    from tests.models.helpers import random_model
    qdir = build_qwen_tokenizer(tmp_path / "qwen_tok")
    vocab = -(-len(load_tokenizer(qdir)) // 128) * 128
    cfg = ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=True)
    save_pretrained(random_model(cfg, seed=2), tmp_path / "qt")
    h = _opd(tmp_path, "run", {"general/high": str(tmp_path / "qt")},
             {"general/high": str(qdir)})
    assert h["teacher/general/high/tokens"] > 0
    assert np.isfinite(h["loss"]) and np.isfinite(h["teacher/general/high/log_ratio"])
    assert 0.0 <= h["teachers/missing_frac"] < 1.0
    assert 0.0 < h["teachers/cross_exact_frac"] < 1.0    # a coarser teacher: not all exact
    with pytest.raises(ValueError, match="teacher vocab .* != student vocab 128"):
        _opd(tmp_path, "bad", {"general/high": str(tmp_path / "qt")})


def test_map_response_carries_specials_and_masks_padding_rows():
    words = Words()
    text_ids = TOK.encode("ab 12")
    eos, user = TOK.eos_token_id, TOK.convert_tokens_to_ids("<|user|>")
    resp = text_ids + [user, 120] + TOK.encode("x") + [eos]      # 120: past the tokenizer
    want = words.encode("ab 12") + [90] + words.encode("x") + [99]
    words.vocab |= {"<|user|>": 90}
    words.eos_token_id = 99
    words.get_vocab = lambda: dict(words.vocab)
    t_ids, assign, exact = map_response(TOK, words, resp)
    assert t_ids == want
    n = len(text_ids)
    assert exact[n] and exact[-1] and not exact[n + 1]
    assert assign[len(words.encode("ab 12"))] == n and assign[-1] == len(resp) - 1
    assert (n + 1) not in set(assign.tolist())


def test_topk_across_tokenizers_maps_the_shared_vocabulary():
    from opd_jax.teachers.cross_tokenizer import map_topk, one_to_one, vocab_map
    words = Words()
    for w in ("ab", "a", "b", " ", "1"):
        words.encode(w)
    words.eos_token_id = len(words.vocab)
    words.vocab["</s>"] = words.eos_token_id
    words.__len__ = None
    vmap = vocab_map(_Sized(words), TOK, len(words.vocab) + 2)
    a, one, ab = words.vocab["a"], words.vocab["1"], words.vocab["ab"]
    assert vmap[a] == TOK.convert_tokens_to_ids("a") and vmap[one] == TOK.encode("1")[0]
    assert vmap[ab] == -1                           # "ab" is two student tokens: no student id
    assert vmap[words.eos_token_id] == TOK.eos_token_id and vmap[-1] == -1
    ids, lp = map_topk(np.array([ab, a, one]), np.log(np.array([0.5, 0.3, 0.1])), vmap)
    assert ids.tolist() == [-1, vmap[a], vmap[one]] and np.isneginf(lp[0])
    dup = vmap.copy()
    dup[one] = dup[a]                               # two teacher ids, one student id: merged
    ids, lp = map_topk(np.array([a, one]), np.log(np.array([0.3, 0.1])), dup)
    assert ids.tolist() == [vmap[a], -1]
    np.testing.assert_allclose(np.exp(lp[0]), 0.4, rtol=1e-6)
    assign, exact = np.array([0, 1, 1]), np.array([True, False])
    assert one_to_one(assign, exact).tolist() == [0, -1]


class _Sized:
    def __init__(self, words):
        self.w, self.eos_token_id = words, words.eos_token_id

    def __len__(self):
        return len(self.w.vocab)

    def decode(self, ids):
        return self.w.decode(ids)


@pytest.mark.slow
def test_topk_with_equal_tokenizers_through_the_cross_path_is_the_plain_path(tmp_path):
    import os
    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    from tests.trainers.test_policy_smoke import ROOT, SMALL, _teacher
    t = _teacher(tmp_path / "t", seed=4)
    small = [o for o in SMALL if not o.startswith("--config.model.")]
    over = small + ["--config.train.steps=1", f"--config.teachers.paths={{'general': '{t}'}}",
                    "--config.model.init_from=builtin:base", "--config.tasks.difficulty=1",
                    "--config.rollout.sampling.max_new_tokens=48"]
    spec = os.path.join(ROOT, "opd_jax/configs/opd.py:topk_distill")
    plain = train_policy(load_config(spec, over), str(tmp_path / "p"), progress=False)
    cross = train_policy(load_config(spec, over + [
        "--config.teachers.tokenizers={'general': 'synthetic'}"]), str(tmp_path / "c"),
        progress=False)
    h_p, h_c = plain["history"][0], cross["history"][0]
    assert h_c["teachers/missing_frac"] == 0.0
    for name in ("loss", "grad_norm", "teacher/general/kl", "teacher/general/topk_mass"):
        np.testing.assert_allclose(h_c[name], h_p[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_cut_through_a_student_token_masks_it_whole():
    """The teacher's context ends inside a student token: that token and every later one get
    no value (not the log-prob of the kept characters alone), earlier ones keep theirs."""
    # student tokens hello, " ", world, " ", 42; a char-level teacher: one token per char
    s_ids = Words().encode("hello world 42")
    spans = char_spans(TOK, TOK.encode("hello world 42", add_special_tokens=False))[1]
    words_spans = [(0, 5), (5, 6), (6, 11), (11, 12), (12, 14)]
    assign, exact = align_assign(words_spans, spans)
    t_ids = list(range(len(spans)))
    assert list(assign) == [0] * 5 + [1] + [2] * 5 + [3] + [4] * 2 and exact.all()
    lp = -np.arange(1, len(t_ids) + 1, dtype=float)
    for keep, valid in ((8, [True, True, False, False, False]),    # cut inside "world"
                        (6, [True, True, False, False, False]),    # just before it
                        (12, [True] * 4 + [False]),                 # inside "42"
                        (14, [True] * 5), (40, [True] * 5)):        # nothing cut
        kept_ids, kept = cut_response(t_ids, assign, keep)
        assert kept_ids == t_ids[:keep] and len(kept) == min(keep, len(t_ids))
        v = gather_values(kept, lp[:len(kept)], len(s_ids))
        assert list(np.isfinite(v)) == valid, keep
        np.testing.assert_allclose(v[:2], [lp[:5].sum(), lp[5]])
        # the top-k signal's one-to-one positions: " " (a single char) while it is kept
        assert list(one_to_one(kept, exact) >= 0) == [False, valid[1], False, valid[3], False]


def test_token_strings_keep_the_sentencepiece_space():
    """A SentencePiece-style decoder drops a text's leading space, so "▁the" decoded alone
    reads "the", the same as "the": a token's string is read inside a text instead, so the
    two stay apart (served top-k strings, the shared vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from opd_jax.teachers.cross_tokenizer import StringIds, TokenString, vocab_map
    vocab = {"<unk>": 0, "▁the": 1, "the": 2, "▁a": 3, "a": 4, "▁cat": 5}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    assert sp.decode([1]) == sp.decode([2]) == "the"         # what decoding alone gives
    text = TokenString(sp)
    assert [text(i) for i in (1, 2, 3, 4, 5)] == [" the", "the", " a", "a", " cat"]
    ids = StringIds(sp)
    assert (ids(" the"), ids("the"), ids(" cat")) == (1, 2, 5)
    # byte-level and character vocabularies read the same either way
    assert all(TokenString(TOK)(i) == TOK.decode([i]) for i in range(len(TOK)))
    # another SentencePiece vocabulary (other ids): " the" maps to " the", "the" to "the"
    tk2 = Tokenizer(models.WordLevel({"<unk>": 0, "▁cat": 1, "▁the": 2, "a": 3, "▁a": 4,
                                      "the": 5}, unk_token="<unk>"))
    tk2.pre_tokenizer, tk2.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp2 = PreTrainedTokenizerFast(tokenizer_object=tk2, unk_token="<unk>")
    assert vocab_map(sp, sp2, 6)[1:].tolist() == [2, 5, 4, 3, 1]


def test_characters_the_teacher_lacks_are_its_unk_token_in_place():
    """A character the teacher's vocabulary lacks (the char-level teacher encodes "\\x0b" as
    <unk>, which decodes to five characters) is its <unk> token at that character: later
    spans stay in place, so the student token holding it takes the teacher's log-prob of
    <unk> and every later token its own (before, the spans shifted and every later student
    token went unscored: the demo's student learned to write \\x0b, which cost nothing)."""
    from opd_jax.models import build_tokenizer
    t = build_tokenizer("synthetic_chatml")
    ids, spans = retokenize(t, "a\x0bbc\x0b\x0b")
    assert ids[1] == ids[4] == ids[5] == t.unk_token_id
    assert spans == [(i, i + 1) for i in range(6)]
    words = [(0, 1), (1, 2), (2, 4), (4, 6)]              # a, \x0b, bc, \x0b\x0b
    assign, exact = align_assign(words, spans)
    assert assign.tolist() == [0, 1, 2, 2, 3, 3] and exact.all()
    assert retokenize(t, "abc") == (t.encode("abc", add_special_tokens=False),
                                    [(0, 1), (1, 2), (2, 3)])


def test_a_topk_larger_than_a_cross_teachers_vocabulary_is_refused_before_work(tmp_path):
    """top_k is checked against each cross-tokenizer teacher's own vocabulary (not only the
    student's) before any rollout: student vocab 256, teacher vocab 128, top_k 200."""
    import os
    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    from tests.trainers.test_policy_smoke import ROOT, SMALL, _teacher
    t = _teacher(tmp_path / "t")
    over = SMALL + ["--config.model.vocab_size=256", "--config.objective.options.top_k=200",
                    f"--config.teachers.paths={{'general': '{t}'}}",
                    "--config.teachers.tokenizers={'general': 'synthetic'}"]
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:topk_distill"), over)
    with pytest.raises(ValueError, match="top_k=200: expected at most teacher 'general''s "
                                         "vocabulary size 128"):
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
