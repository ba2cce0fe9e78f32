"""Pieces of the policy trainers: sequence batches, teacher alignment, bank, objectives."""
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax import envs, losses
from opd_jax.models import ModelConfig, save_pretrained
from opd_jax.teachers import TeacherBank, teacher_weights
from opd_jax.trainers.objectives import make_objective, student_logp
from opd_jax.episodes.sequences import align_to_student, build_sequences
from tests.models.helpers import random_model

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8)


def test_build_sequences_layout():
    s = build_sequences([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]],
                        response_masks=[[1, 1], [1, 0, 1]],
                        sampler_logps=[[-0.5, -0.6], [-0.1, 0.0, -0.3]], multiple=4)
    assert s["inputs"].shape == (2, 4)
    np.testing.assert_array_equal(s["inputs"][0], [1, 2, 3, 5])
    np.testing.assert_array_equal(s["targets"][0], [2, 3, 5, 6])
    np.testing.assert_array_equal(s["mask"][0], [0, 0, 1, 1])      # targets 5, 6
    np.testing.assert_array_equal(s["targets"][1], [7, 8, 9, 0])
    np.testing.assert_array_equal(s["mask"][1], [1, 0, 1, 0])      # the observation 8 is 0
    np.testing.assert_allclose(s["sampler_logp"][1], [-0.1, 0.0, -0.3, 0.0])
    np.testing.assert_array_equal(s["segment_ids"][1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="row 0: empty prompt"):
        build_sequences([[]], [[1]])
    with pytest.raises(ValueError, match="row 0: 1 sampler log-probs for 2 tokens"):
        build_sequences([[1]], [[2, 3]], sampler_logps=[[0.0]])


def test_teacher_alignment_matches_teacher_positions():
    prompts_s, prompts_t, resp = [[9, 9, 1, 2], [9, 3]], [[1, 2], [3]], [[5, 6, 7], [8]]
    s = build_sequences(prompts_s, resp, multiple=8)
    t = build_sequences(prompts_t, resp, multiple=8)
    # Teacher "values" = its targets: aligned, they must equal the student's targets.
    aligned = align_to_student(jnp.asarray(t["targets"]), jnp.asarray(t["prompt_len"]),
                               jnp.asarray(s["prompt_len"]), s["targets"].shape[1])
    m = s["mask"].astype(bool)
    np.testing.assert_array_equal(np.asarray(aligned)[m], s["targets"][m])
    hidden = jnp.asarray(t["targets"])[..., None] * jnp.ones((1, 1, 3))
    aligned3 = align_to_student(hidden, jnp.asarray(t["prompt_len"]),
                                jnp.asarray(s["prompt_len"]), s["targets"].shape[1])
    np.testing.assert_array_equal(np.asarray(aligned3)[..., 0][m], s["targets"][m])


def _write_teacher(path, cfg=CFG, seed=0):
    save_pretrained(random_model(cfg, seed=seed), path)
    return str(path)


def test_teacher_bank_lru_and_errors(tmp_path):
    paths = {k: _write_teacher(tmp_path / k, seed=i) for i, k in enumerate("abc")}
    bank = TeacherBank(paths, max_loaded=2)
    assert set(bank.validate(student_vocab=32)) == {"a", "b", "c"}
    bank.get("a"), bank.get("b"), bank.get("a"), bank.get("c")
    assert bank.loaded() == ["a", "c"]                       # b was least recently used
    assert bank.events == [("load", "a"), ("load", "b"), ("load", "c"), ("evict", "b")]
    assert bank.stats == {"loads": 3, "evictions": 1, "hits": 1}
    with pytest.raises(ValueError, match="teacher vocab 32 != student vocab 64 \\(teacher 'a'"):
        bank.validate(student_vocab=64)
    with pytest.raises(KeyError, match="no teacher for 'zzz'; the bank has: a, b, c"):
        bank.get("zzz")
    with pytest.raises(FileNotFoundError, match="teacher .*checkpoint .*missing.* does not exist"):
        TeacherBank({"x": str(tmp_path / "missing")}).validate(32)


def route(task, routing, table):
    return teacher_weights(task.domain, task.effort, routing, table=table)


def test_routing_errors():
    task = envs.TaskSource("arithmetic", size=1, effort="max")[0]
    assert route(task, "cell", {}) == {"general/max": 1.0}
    assert route(task, "domain", {}) == {"general": 1.0}
    assert route(task, "table", {"general": "stage1"}) == {"stage1": 1.0}
    with pytest.raises(KeyError, match="no teacher for \\(domain, effort\\) 'general/max'"):
        route(task, "table", {"agent": "x"})


def test_make_objective_errors():
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        make_objective("ppo")
    with pytest.raises(ValueError, match="has no option\\(s\\) \\['rmax'\\]"):
        make_objective("kimi_mopd", rmax=1.0)


def _batch(B=3, T=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"inputs": jnp.asarray(rng.integers(0, 32, (B, T)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, 32, (B, T)), jnp.int32),
            "segment_ids": jnp.ones((B, T), jnp.int32),
            "mask": jnp.asarray(rng.integers(0, 2, (B, T)), jnp.int32)}


def test_deepseek_objective_equals_full_logits_reverse_kl():
    student, t1, t2 = (random_model(CFG, seed=s) for s in (0, 1, 2))
    batch = _batch()
    weights = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    hs = [t(batch["inputs"], segment_ids_BxT=batch["segment_ids"], return_hidden=True)
          for t in (t1, t2)]
    batch |= {"teacher_hidden": tuple(h * weights[:, s, None, None] for s, h in enumerate(hs)),
              "teacher_weights": weights}
    obj = make_objective("deepseek_full_vocab", implementation="xla")
    loss, metrics = obj(student, batch, (t1.unembedding(), t2.unembedding()))
    logits_s = student(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
    teacher_logits = jnp.stack([t.logits(h) for t, h in zip((t1, t2), hs)])
    ref, _ = losses.reverse_kl_loss(logits_s, teacher_logits, batch["mask"], weights=weights)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6)


def test_kimi_objective_equals_loss_and_logs_per_teacher():
    student = random_model(CFG)
    batch = _batch()
    teacher_logp = student_logp(random_model(CFG, seed=3), batch)
    batch |= {"teacher_logp": teacher_logp, "old_logp": teacher_logp * 0,
              "sampler_logp": teacher_logp * 0,
              "teacher_onehot": jnp.asarray([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])}
    obj = make_objective("kimi_mopd", r_max=2.0, correction=None)
    loss, metrics = obj(student, batch)
    ref, _ = losses.kimi_mopd_loss(student_logp(student, batch), teacher_logp, batch["mask"],
                                   r_max=2.0)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    m1 = batch["mask"] * batch["teacher_onehot"][:, 1:2]
    ratio = teacher_logp - student_logp(student, batch)
    np.testing.assert_allclose(metrics["teacher/log_ratio"][1],
                               jnp.sum(ratio * m1) / jnp.sum(m1), rtol=1e-5)


def test_policy_rows_must_split_over_minibatches_and_devices():
    import ml_collections

    from opd_jax.trainers.builders import policy_rows
    cfg = ml_collections.ConfigDict(dict(rollout=dict(prompts_per_step=8, group_size=4),
                                         rl=dict(minibatches=4)))
    assert policy_rows(cfg, 8) == 32
    cfg.rl.minibatches = 3
    with pytest.raises(ValueError, match="rl.minibatches=3"):
        policy_rows(cfg, 1)
    cfg.rl.minibatches = 8
    with pytest.raises(ValueError, match="expected a multiple of 64"):
        policy_rows(cfg, 8)


@pytest.mark.parametrize("kind", ["logp", "hidden"])
def test_teacher_scorer_scores_routed_rows_in_chunks(tmp_path, kind):
    """Each teacher scores only its rows, chunk by chunk; values equal one whole-batch pass."""
    import dataclasses

    from opd_jax.models import synthetic_tokenizer
    from opd_jax.models import ModelRef
    from opd_jax.episodes import Episode, encode
    from opd_jax.teachers.scoring import teacher_outputs
    from opd_jax.teachers import TeacherScorer as _TeacherScorer, in_row_chunks
    from flax import nnx
    cfg = dataclasses.replace(CFG, vocab_size=128)
    paths = {k: _write_teacher(tmp_path / k, cfg, seed=i) for i, k in enumerate("ab")}
    tok = synthetic_tokenizer()
    rng = np.random.default_rng(0)
    tasks = list(envs.TaskSource("arithmetic", size=6, seed=0))
    bos = [tok.bos_token_id]
    eps = [Episode(t, bos + encode(tok, envs.render_prompt(t)),
                   response_ids=[int(x) for x in rng.integers(3, 100, size=n)])
           for t, n in zip(tasks, [3, 5, 2, 4, 6, 1])]
    seqs = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps])
    weights = [{"b": 1.0} if b % 3 == 0 else {"a": 1.0} for b in range(6)]   # b: rows 0, 3
    whole = _TeacherScorer(TeacherBank(paths), tok, kind)(eps, weights, seqs)
    chunked = _TeacherScorer(TeacherBank(paths), tok, kind, chunk_rows=3)(eps, weights, seqs)
    m = seqs["mask"].astype(bool)
    for key, rows in (("a", [1, 2, 4, 5]), ("b", [0, 3])):
        assert whole[key][0] == chunked[key][0] == rows
        # Reference: the teacher on every row at once (the student's prompts), aligned.
        teacher = ModelRef(paths[key]).load()
        g, p, r = nnx.split(teacher, nnx.Param, ...)
        ref = np.asarray(teacher_outputs(p, r, seqs, graphdef=g, kind=kind))
        for got in (whole[key][1], chunked[key][1]):
            got = np.asarray(got)
            assert got.shape == ref.shape
            np.testing.assert_allclose(got[rows][m[rows]], ref[rows][m[rows]], atol=1e-5)
            others = [b for b in range(6) if b not in rows]
            assert not got[others].any()                  # rows it does not score: zeros
    with pytest.raises(ValueError, match="scoring chunk of 4 rows for a batch of 6"):
        in_row_chunks(lambda x: x, {"x": np.zeros((6, 2))}, 4)


@pytest.mark.parametrize("kind", ["logp", "topk"])
def test_cross_tokenizer_scoring_in_chunks_equals_the_plain_scorer(tmp_path, kind):
    """The cross-tokenizer path (here with the student's own tokenizer) scores its rows in
    `chunk_rows` chunks padded like the plain path's: the values equal the plain scorer's,
    whole or chunked (4 routed rows in chunks of 3)."""
    import dataclasses

    from opd_jax.models import synthetic_tokenizer
    from opd_jax.episodes import Episode, encode
    from opd_jax.teachers import TeacherScorer as _TeacherScorer
    cfg = dataclasses.replace(CFG, vocab_size=128)
    paths = {k: _write_teacher(tmp_path / k, cfg, seed=i) for i, k in enumerate("ab")}
    tok = synthetic_tokenizer()
    rng = np.random.default_rng(1)
    tasks = list(envs.TaskSource("arithmetic", size=6, seed=0))
    bos = [tok.bos_token_id]
    eps = [Episode(t, bos + encode(tok, envs.render_prompt(t)),
                   response_ids=[int(x) for x in rng.integers(20, 90, size=n)])
           for t, n in zip(tasks, [3, 5, 2, 4, 6, 1])]
    seqs = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps])
    weights = [{"b": 1.0} if b % 3 == 0 else {"a": 1.0} for b in range(6)]
    kw = dict(top_k=5) if kind == "topk" else {}
    plain = _TeacherScorer(TeacherBank(paths), tok, kind, **kw)(eps, weights, seqs)
    m = seqs["mask"].astype(bool)
    for chunk in (0, 3):
        scorer = _TeacherScorer(TeacherBank(paths), tok, kind, chunk_rows=chunk,
                                tokenizers={"a": tok, "b": tok}, **kw)
        cross = scorer(eps, weights, seqs)
        for key in "ab":
            rows = cross[key][0]
            assert rows == plain[key][0]
            assert not np.asarray(scorer.invalid[key])[m].any()
            got, want = cross[key][1], plain[key][1]
            got, want = (got, want) if kind == "topk" else ((got,), (want,))
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g)[rows][m[rows]],
                                           np.asarray(w)[rows][m[rows]], atol=1e-5)


def test_teacher_forwards_take_few_shapes_whatever_the_rows_routed(tmp_path):
    # A teacher's forward compiled once per number of rows routed to it (and per its own
    # bucket of their length): with 6 teachers, new shapes kept compiling mid-run.
    import dataclasses

    from opd_jax.models import synthetic_tokenizer
    from opd_jax.episodes import Episode, encode
    from opd_jax.recipes.pipeline import CompileClock
    from opd_jax.teachers import TeacherScorer as _TeacherScorer
    cfg = dataclasses.replace(CFG, vocab_size=128)
    paths = {"a": _write_teacher(tmp_path / "a", cfg, seed=0)}
    tok = synthetic_tokenizer()
    scorer = _TeacherScorer(TeacherBank(paths), tok, "logp", chunk_rows=8)
    assert [scorer._chunk(n) for n in (1, 2, 3, 5, 7, 8, 9, 20)] == [1, 2, 4, 8, 8, 8, 8, 8]
    tasks = list(envs.TaskSource("arithmetic", size=8, seed=0))
    bos = [tok.bos_token_id]
    eps = [Episode(t, bos + encode(tok, envs.render_prompt(t)), response_ids=[5] * 4)
           for t in tasks]
    seqs = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                           seq_len=64)       # the student's rows (grow-only length)
    scorer(eps, [{"a": 1.0}] * 7 + [{}], seqs)               # 7 rows: one chunk of 8
    with CompileClock() as clock:
        for n in (5, 6, 8):                                  # 5..8 rows: the same chunk
            out = scorer(eps, [{"a": 1.0}] * n + [{}] * (8 - n), seqs)
            assert np.asarray(out["a"][1]).shape == (8, 64)
    assert clock.compiles == 0
