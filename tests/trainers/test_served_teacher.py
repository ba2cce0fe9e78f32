"""Served teachers (`opd_jax.teachers.served`): the three protocols' documented response
formats parsed, a server on 127.0.0.1 answering from a model equal to the in-process teacher
(log-probs and top-k within fp32 of ours, and an OPD step equal to the in-process one), and
every known server bug refused or worked around at start-up: shifted echo log-probs,
temperature ignored, no log-probs, another vocabulary, a server down, slow or warming up."""
from __future__ import annotations

import os
import socket

import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax.config import load_config
from opd_jax.losses import log_softmax
from opd_jax.models import ModelRef, synthetic_tokenizer
from opd_jax.teachers.served import (ServedTeacher, ServedTeacherError, StringIds, parse_openai,
                                     parse_sglang, parse_spec, parse_vllm)
from opd_jax.trainers.run_policy import train_policy
from tests.trainers.fake_server import FakeServer
from tests.trainers.test_policy_smoke import ROOT, SMALL, _teacher

TOK = synthetic_tokenizer()


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    path = _teacher(tmp_path_factory.mktemp("served") / "t", seed=3)
    return path, ModelRef(path).load()


def _rows():
    return [TOK.encode("12 + 30 = 42"), TOK.encode("abc def"), TOK.encode("x = 7; y = x")]


def _model_lp(model, ids, temperature=1.0):
    logits = model(jnp.asarray([ids], jnp.int32))[0]
    return np.asarray(log_softmax(logits, temperature))       # [L, V]: the next token


# -- the documented formats ---------------------------------------------------------------------
def test_parsers_read_the_documented_formats():
    ids = [5, 9, 7]
    vllm = {"index": 0, "prompt_logprobs": [
        None,
        {"9": {"logprob": -1.5, "rank": 3, "decoded_token": "b"},
         "4": {"logprob": -0.2, "rank": 1, "decoded_token": "x"},
         "6": {"logprob": -1.1, "rank": 2, "decoded_token": "y"}},
        {"7": {"logprob": -0.1, "rank": 1, "decoded_token": "c"},
         "2": {"logprob": -2.5, "rank": 2, "decoded_token": "z"}}]}
    ps = parse_vllm(vllm, ids, k=2)
    np.testing.assert_allclose(ps.lp[1:], [-1.5, -0.1])
    assert ps.top_ids[1].tolist() == [4, 6] and ps.top_ids[2].tolist() == [7, 2]
    assert ps.strings[1:] == ["b", "c"]
    sglang = {"meta_info": {
        "input_token_logprobs": [[None, 5, "a"], [-1.5, 9, "b"], [-0.1, 7, "c"]],
        "input_top_logprobs": [None, [[-0.2, 4, "x"], [-1.1, 6, "y"]],
                               [[-0.1, 7, "c"], [-2.5, 2, "z"]]]}}
    ps2 = parse_sglang(sglang, ids, k=2)
    np.testing.assert_allclose(ps2.lp, ps.lp, equal_nan=True)
    np.testing.assert_array_equal(ps2.top_ids, ps.top_ids)
    with pytest.raises(ServedTeacherError, match="misaligned"):
        parse_sglang(sglang, [5, 8, 7], k=2, server="http://s")
    strings = {"x": 4, "y": 6, "c": 7, "z": 2}
    openai = {"logprobs": {"tokens": ["a", "b", "c"], "token_logprobs": [None, -1.5, -0.1],
                           "top_logprobs": [None, {"x": -0.2, "y": -1.1},
                                            {"c": -0.1, "z": -2.5}]}}
    ps3 = parse_openai(openai, ids, 2, strings.get, "abc", [(0, 1), (1, 2), (2, 3)])
    np.testing.assert_array_equal(ps3.top_ids, ps.top_ids)
    np.testing.assert_allclose(ps3.top_lp, ps.top_lp)
    np.testing.assert_allclose(ps3.lp, ps.lp, equal_nan=True)
    # a server that leaves out the leading token: the rest still lines up
    cut = {"logprobs": {k: v[1:] for k, v in openai["logprobs"].items()}}
    ps4 = parse_openai(cut, ids, 2, strings.get, "abc", [(0, 1), (1, 2), (2, 3)])
    np.testing.assert_allclose(ps4.lp[2], -0.1)
    # shift 1: token j's values come from index j - 1
    ps5 = parse_openai(openai, ids, 2, strings.get, "abc", [(0, 1), (1, 2), (2, 3)], shift=1)
    assert np.isnan(ps5.lp[1]) and np.isnan(ps5.lp[2])     # 'c' is not in index 1's top-k
    assert ps5.top_ids[2].tolist() == [4, 6]
    # a trailing special echoed as "" (ours: an empty span at the end) is scored; the
    # generated token after it ("" too here) is not read as the prompt's
    tail = {"logprobs": {"tokens": ["a", "b", "", ""], "token_logprobs": [None, -1.5, -0.3, -9.0],
                         "top_logprobs": [None, {"x": -0.2}, {"z": -0.3}, {"x": -9.0}]}}
    ps6 = parse_openai(tail, [5, 9, 2], 2, strings.get, "ab", [(0, 1), (1, 2), (2, 2)])
    np.testing.assert_allclose(ps6.lp[1:], [-1.5, -0.3])
    assert ps6.top_ids[2].tolist() == [2, -1]
    ps7 = parse_openai(tail, [5, 9], 2, strings.get, "ab", [(0, 1), (1, 2)])
    np.testing.assert_allclose(ps7.lp[1:], [-1.5])              # no trailing special: stop
    with pytest.raises(ServedTeacherError, match="http://v: returned no prompt_logprobs"):
        parse_vllm({"index": 0}, ids, 2, server="http://v")
    assert parse_spec("vllm+http://h:1/?model=Qwen/Qwen3-8B") == ("vllm", "http://h:1",
                                                                   "Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="expected <protocol>\\+http"):
        parse_spec("tgi+http://h:1")


# -- a server answering from the model ----------------------------------------------------------
@pytest.mark.parametrize("protocol", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_logprobs_and_top_k_equal_the_model(teacher, protocol, temperature):
    _, model = teacher
    with FakeServer(model, TOK) as srv:
        client = ServedTeacher(f"{protocol}+{srv.url}", TOK, top_k=4, temperature=temperature,
                               batch_rows=2)
        found = client.probe()
        assert found["inconsistent"] == 0 and not client.top_only
        rows = _rows()
        for ids, ps in zip(rows, client.score(rows)):
            lp = _model_lp(model, ids, temperature)
            want = [lp[j - 1, ids[j]] for j in range(1, len(ids))]
            np.testing.assert_allclose(ps.lp[1:], want, rtol=1e-5, atol=1e-6)
            top = np.argsort(-lp[:-1], axis=-1)[:, :4]
            if protocol == "openai":     # strings: ids no single string names are dropped
                names = StringIds(TOK)   # (from the top 20 it asks for, the first 4 kept)
                kept = [[t for t in row if names(TOK.decode([int(t)])) == t][:4]
                        for row in np.argsort(-lp[:-1], axis=-1)[:, :20]]
                top = np.array([row + [-1] * (4 - len(row)) for row in kept])
            np.testing.assert_array_equal(ps.top_ids[1:], top)
        # every request asked at the objective's temperature, never the server default
        asked = [b.get("temperature", b.get("sampling_params", {}).get("temperature"))
                 for _, b in srv.requests]
        assert set(asked) == ({temperature, 1.0} if temperature != 1.0 else {1.0})
        if protocol != "openai":     # batched: 3 rows in requests of 2 (+ the probe)
            assert len(srv.requests) == 1 + (temperature != 1.0) + 2


def test_shifted_echo_logprobs_are_detected_and_the_top_k_used(teacher):
    """llama-cpp-python's echo (prompts not opening with the model's BOS) puts at index j
    the distribution of token j + 1: the client finds it from the server's own generation
    path and reads token j's values at index j - 1, its log-prob from that top-k (a token
    outside it: NaN, counted; too many: refused)."""
    _, model = teacher
    with FakeServer(model, TOK, shift=True) as srv:
        client = ServedTeacher(f"openai+{srv.url}", TOK, top_k=0, max_missing=1.0)
        assert client.probe()["shift"] == 1
        rows = _rows()
        got = client.score(rows, starts=[1, 1, 1])
        for ids, ps in zip(rows, got):
            lp = _model_lp(model, ids)
            for j in range(1, len(ids)):
                in_top = ids[j] in np.argsort(-lp[j - 1])[:20]
                assert np.isnan(ps.lp[j]) != in_top
                if in_top:
                    np.testing.assert_allclose(ps.lp[j], lp[j - 1, ids[j]], rtol=1e-5)
        assert client.stats["missing"] == sum(int(np.isnan(p.lp[1:]).sum()) for p in got) > 0
        strict = ServedTeacher(f"openai+{srv.url}", TOK, max_missing=0.0)
        strict.probe()
        with pytest.raises(ServedTeacherError, match="have no sampled-token log-prob .* > max_missing 0%"):
            strict.score(rows)
        # A top-k signal reads the top-k entries only: a sampled token outside them (its own
        # log-prob NaN here) is not missing; only a position with no entries is (each row's
        # first token, whose distribution the shifted echo does not hold).
        topk = ServedTeacher(f"openai+{srv.url}", TOK, top_k=5, max_missing=0.5)
        topk.probe()
        got = topk.score(rows, starts=[1, 1, 1])
        no_top = sum(int((~(p.top_ids[1:] >= 0).any(-1)).sum()) for p in got)
        assert topk.stats["missing"] == no_top == len(rows) < client.stats["missing"]


def test_bad_servers_are_refused_at_start_naming_them(teacher):
    _, model = teacher
    with FakeServer(model, TOK, raw_temp=True) as srv:
        with pytest.raises(ServedTeacherError, match=f"{srv.url} returns the same log-probs at "
                                                     f"temperature 0.7 as at 1"):
            ServedTeacher(f"vllm+{srv.url}", TOK, temperature=0.7).probe()
        ServedTeacher(f"vllm+{srv.url}", TOK, temperature=1.0).probe()      # fine at T = 1
    with FakeServer(model, TOK, no_logprobs=True) as srv:
        for proto in ("vllm", "sglang", "openai"):
            with pytest.raises(ServedTeacherError, match=f"teacher server {srv.url}: "
                                                         f"returned no"):
                ServedTeacher(f"{proto}+{srv.url}", TOK).probe()
    with FakeServer(model, TOK, other_vocab=True) as srv:
        with pytest.raises(ServedTeacherError, match="uses a different vocabulary: token 68 "
                                                     "at probe position 0|uses a different "
                                                     "vocabulary"):
            ServedTeacher(f"sglang+{srv.url}", TOK).probe()
    with FakeServer(model, TOK, no_top=True) as srv:     # sampled tokens only, no top-k
        ServedTeacher(f"sglang+{srv.url}", TOK).probe()  # fine for a sampled-token signal
        with pytest.raises(ServedTeacherError, match=f"{srv.url} returned top-k log-probs at 0 "
                                                     f"of \\d+ probe positions"):
            ServedTeacher(f"sglang+{srv.url}", TOK, top_k=4).probe()
    with socket.socket() as s:                 # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = ServedTeacher(f"vllm+http://127.0.0.1:{port}", TOK, retries=1, timeout_s=2)
    with pytest.raises(ServedTeacherError, match=f"127.0.0.1:{port}/v1/completions: no answer "
                                                 f"after 2 tries .*is it running"):
        down.probe()
    with FakeServer(model, TOK, fail_first=2) as srv:      # warming up: 503, 503, then fine
        client = ServedTeacher(f"sglang+{srv.url}", TOK, retries=3)
        client.probe()
        assert client.stats["retries"] == 2
    with FakeServer(model, TOK, delay_s=1.5) as srv:
        slow = ServedTeacher(f"vllm+{srv.url}", TOK, retries=1, timeout_s=0.3)
        with pytest.raises(ServedTeacherError, match="no answer after 2 tries"):
            slow.probe()
    with pytest.raises(ValueError, match="top_k=-1"):
        ServedTeacher("vllm+http://h:1", TOK, top_k=-1)


def test_string_ids_map_unique_decodings_only():
    ids = StringIds(TOK)
    assert ids("T") == TOK.encode("T")[0] and ids("no such token") is None


# -- an OPD step with a served teacher ----------------------------------------------------------
@pytest.mark.parametrize("objective, protocol", [
    ("kimi_mopd", "vllm"), pytest.param("topk_distill", "sglang", marks=pytest.mark.slow)])
def test_an_opd_step_with_a_served_teacher_equals_the_in_process_one(teacher, tmp_path,
                                                                     objective, protocol):
    path, model = teacher
    key = "general/high" if objective == "kimi_mopd" else "general"
    spec = os.path.join(ROOT, f"opd_jax/configs/opd.py:{objective}")
    over = SMALL + ["--config.train.steps=1"]
    local = load_config(spec, over + [f"--config.teachers.paths={{'{key}': '{path}'}}"])
    h_local = train_policy(local, str(tmp_path / "local"), progress=False)["history"][0]
    with FakeServer(model, TOK) as srv:
        served = load_config(spec, over + [
            f"--config.teachers.paths={{'{key}': '{protocol}+{srv.url}'}}",
            "--config.teachers.served.params={'%s': 12345}" % key])
        h_served = train_policy(served, str(tmp_path / "served"), progress=False)["history"][0]
        assert any(p == ("/generate" if protocol == "sglang" else "/v1/completions")
                   for p, _ in srv.requests[1:])
    assert h_served["teachers/missing_frac"] == 0.0
    for name in ("loss", "grad_norm", f"teacher/{key}/tokens",
                 f"teacher/{key}/" + ("log_ratio" if objective == "kimi_mopd" else "kl")):
        np.testing.assert_allclose(h_served[name], h_local[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_a_served_teacher_with_the_hidden_state_signal_is_refused():
    from opd_jax.teachers import TeacherBank, TeacherScorer
    bank = TeacherBank({"general": "vllm+http://127.0.0.1:9"})
    assert bank.is_served("general") and bank.validate(128) == {}
    with pytest.raises(ValueError, match="a server sends log-probs, not hidden states"):
        TeacherScorer(bank, TOK, "hidden").served("general")
    with pytest.raises(ValueError, match="is served by vllm\\+http://127.0.0.1:9"):
        bank.get("general")
    with pytest.raises(ValueError, match="expected <protocol>\\+http"):
        TeacherBank({"general": "vllm+ftp://x"})


def test_retries_cover_rate_limits_and_cut_answers_but_not_client_errors():
    import io
    import json as _json
    import urllib.error
    answers = []

    def post(path, payload, timeout):
        e = answers.pop(0)
        if isinstance(e, Exception):
            raise e
        return e

    def http(code):
        return urllib.error.HTTPError("http://h:1/x", code, "msg", {}, io.BytesIO(b"busy"))
    client = ServedTeacher("vllm+http://h:1", TOK, retries=3, post=post)
    answers[:] = [http(429), _json.JSONDecodeError("cut", "{", 1), {"ok": 1}]
    assert client.post("/x", {}) == {"ok": 1} and client.stats["retries"] == 2
    answers[:] = [http(404)]
    with pytest.raises(ServedTeacherError, match="http://h:1/x answered HTTP 404: busy"):
        client.post("/x", {})
    answers[:] = [http(429)] * 4
    with pytest.raises(ServedTeacherError, match="no answer after 4 tries \\(HTTP 429"):
        client.post("/x", {})
