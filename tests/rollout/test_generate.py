"""The sampler end to end on a tiny model: teacher-forced log-probs, stops, budgets,
padding, pause/resume, compile counts, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout_fixtures import CompileCounter, full_logits, random_model

from opd_jax.models import synthetic_tokenizer
from opd_jax.rollout import SamplingParams, generate, process_logits, resume, sample

PROMPTS = [[1, 20, 30, 40, 50], [1, 60], [1, 70, 80], [1, 9, 9, 9]]  # B=4 as elsewhere
MAX_LEN = 64


@pytest.fixture(scope="module")
def model():
    return random_model(seed=0)


@pytest.fixture(scope="module")
def tok():
    return synthetic_tokenizer()


def run(model, **kw):
    kw = {"max_new_tokens": 12, "max_len": MAX_LEN, **kw}
    return generate(model, PROMPTS, **kw)


def forward(model, seq):
    """Logits of a no-cache forward over `seq`, right-padded to 32 (one compile)."""
    x, mask = np.zeros((1, 32), np.int32), np.zeros((1, 32), np.int32)
    x[0, :len(seq)], mask[0, :len(seq)] = seq, 1
    return full_logits(model, x, mask)[0, :len(seq)]


def teacher_forced_logp(model, prompt, new, **proc):
    """log p of `new` under process_logits of a no-cache forward over prompt + new."""
    logits = forward(model, prompt + new)[len(prompt) - 1:-1]
    params = SamplingParams.create(len(new), **proc)
    lp = process_logits(logits, params)
    return np.asarray(lp)[np.arange(len(new)), new]


def test_greedy_matches_full_forward_argmax(model):
    res = run(model, temperature=0.0)
    for p, new in zip(PROMPTS, res.tokens):
        seq = list(p)
        for _ in range(len(new)):
            seq.append(int(np.argmax(forward(model, seq)[-1])))
        assert seq[len(p):] == new
    assert res.finish_reasons == ["length"] * 4 and all(len(t) == 12 for t in res.tokens)
    assert all(lp == 0.0 for row in res.logprobs for lp in row)  # greedy: a point mass


@pytest.mark.parametrize("proc", [dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                                  dict(temperature=1.3, top_p=0.8)])
def test_logprobs_equal_teacher_forced(model, proc):
    res = run(model, seed=3, **proc)
    for p, new, lp in zip(PROMPTS, res.tokens, res.logprobs):
        np.testing.assert_allclose(lp, teacher_forced_logp(model, p, new, **proc), atol=1e-5)


def test_seeded_reproducible_and_batch_independent(model):
    a, b = run(model, seed=5), run(model, seed=5)
    assert a.tokens == b.tokens and run(model, seed=6).tokens != a.tokens
    # rows keep their draws wherever they sit in the batch (the stream follows row_ids)
    swapped = generate(model, [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]],
                       max_new_tokens=12, max_len=MAX_LEN, seed=5, row_ids=[1, 0, 2, 3])
    assert swapped.tokens == [a.tokens[1], a.tokens[0], a.tokens[2], a.tokens[3]]


def test_changing_knobs_does_not_recompile(model):
    run(model, temperature=0.5, stop_token_ids=[3], seed=0)  # warm up this shape
    with CompileCounter() as c:
        run(model, temperature=0.9, top_p=0.7, top_k=5, stop_token_ids=[4, 9], seed=1,
            max_new_tokens=[3, 7, 12, 1])
    assert c.count == 0, f"{c.count} compiles"


def test_first_call_compiles_only_the_engine_programs(model):
    """A first generate on a new shape compiles the engine's four programs (the empty
    cache, extend, decode, pack) and nothing else: its host-side set-up (the state, the
    sampling tables, the prompts' alignment, the PRNG key) runs no eager device op, each of
    which would compile a small program on a process's first call."""
    # a persistent compilation cache (turned on in this process by any in-process CLI test)
    # would serve a program without a compile event: off for this call
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with CompileCounter() as c:
            generate(model, [[1, 2, 3]] * 5, max_new_tokens=4, max_len=72, seed=7,
                     temperature=0.8, stop_token_ids=[2])
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    assert c.count == 4, f"{c.count} compiles"


@pytest.mark.parametrize("seed", [0, 5, -1, 2**31 - 1, -2**31])
def test_host_key_equals_jax_random_key(seed):
    from opd_jax.rollout.engine import host_key
    assert jax.random.key_impl(host_key(seed)) == jax.random.key_impl(jax.random.key(seed))
    np.testing.assert_array_equal(jax.random.key_data(host_key(seed)),
                                  jax.random.key_data(jax.random.key(seed)))
    np.testing.assert_array_equal(jax.random.uniform(host_key(seed), (3,)),
                                  jax.random.uniform(jax.random.key(seed), (3,)))


def test_stop_ids_strings_and_per_row_limits(model, tok):
    base = run(model, seed=2)
    stop = base.tokens[0][4]
    res = run(model, seed=2, stop_token_ids=[stop], max_new_tokens=[12, 3, 12, 12])
    for b, (full, new) in enumerate(zip(base.tokens, res.tokens)):
        limit = 3 if b == 1 else 12
        cut = full.index(stop) + 1 if stop in full[:limit] else limit
        assert new == full[:cut], b
        assert res.finish_reasons[b] == ("stop" if stop in full[:limit] else "length")
    # a two-token stop string from row 2 (ids the tokenizer knows, first occurrence)
    row = base.tokens[2]
    i = next(i for i in range(1, 11) if max(row[i:i + 2]) < len(tok)
             and all(row[j:j + 2] != row[i:i + 2] for j in range(i)))
    res = run(model, seed=2, stop_strings=[tok.decode(row[i:i + 2])], tokenizer=tok)
    assert res.tokens[2] == row[:i + 2] and res.finish_reasons[2] == "stop"


def test_think_budget_forces_close_per_row(model, tok):
    think, close = tok.convert_tokens_to_ids(["<think>", "</think>"])
    prompts = [p + [think] for p in PROMPTS]
    for seed in range(10):  # a seed where the model does not close early by itself
        free = generate(model, prompts, max_new_tokens=10, max_len=MAX_LEN, seed=seed)
        if close not in free.tokens[0][:1] + free.tokens[1][:4]:
            break
    res = generate(model, prompts, max_new_tokens=10, max_len=MAX_LEN, seed=seed,
                   think_budget=[0, 3, None, None], tokenizer=tok)
    assert res.tokens[0][0] == close and res.logprobs[0][0] == 0.0
    assert res.tokens[1][:3] == free.tokens[1][:3] and res.tokens[1][3] == close
    assert res.tokens[2] == free.tokens[2]
    forced = np.asarray(res.batch.forced_mask_BxL)
    mask = np.asarray(res.batch.response_mask_BxL)
    assert forced.sum(axis=1).tolist() == [1, 1, 0, 0] and not (forced & mask).any()


def test_left_and_right_padding_agree_and_pause_resume(model):
    P = 8
    left, right = np.zeros((4, P), np.int32), np.zeros((4, P), np.int32)
    for b, p in enumerate(PROMPTS):
        left[b, P - len(p):], right[b, :len(p)] = p, p
    lens = np.array([len(p) for p in PROMPTS], np.int32)
    params = SamplingParams.create(4, temperature=1.0)
    kw = dict(seed=4, max_new_B=np.array([12, 6, 12, 12]), max_len=MAX_LEN)
    a, _ = sample(model, left, lens, params, **kw)
    b, _ = sample(model, right, lens, params, padding="right", **kw)
    np.testing.assert_array_equal(a.tokens_BxL, b.tokens_BxL)
    c, state = sample(model, right, lens, params, padding="right", max_steps=4, **kw)
    assert np.asarray(c.finish_reason_B).tolist() == [3] * 4  # paused: BUDGET
    while bool(jnp.any(state.active_B)):
        c, state = resume(model, state, params, 4)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)):
        np.testing.assert_allclose(x, y, atol=1e-6)
    L = int(a.lengths_B[1])
    assert L == 2 + 6 and np.asarray(a.response_mask_BxL[1]).tolist()[:L] == [0] * 2 + [1] * 6
    assert int(a.prompt_lens_B[0]) == 5 and np.asarray(a.finish_reason_B).tolist() == [2] * 4


def test_bad_input(model, tok):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"longest prompt has 70 tokens; it does not fit"):
        generate(model, [[1] * 70], max_new_tokens=4, max_len=64)
    with pytest.raises(ValueError, match=r"think_budget=-1: expected an int >= 0 or None"):
        generate(model, [[1]], max_new_tokens=4, think_budget=-1, tokenizer=tok)
    with pytest.raises(ValueError, match=r"stop string 'é' tokenizes to \[3\]"):
        generate(model, [[1]], max_new_tokens=4, stop_strings=["é"], tokenizer=tok)
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate(model, [[1]], max_new_tokens=4, stop_strings=["a"])
    with pytest.raises(ValueError, match=r"token ids \[500\] outside \[0, 128\)"):
        generate(model, [[1, 500]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries, expected one per"):
        generate(model, [[1]], max_new_tokens=[1, 2])
