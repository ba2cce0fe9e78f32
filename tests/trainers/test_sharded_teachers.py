"""Teachers on the mesh (8 fake devices): the bank reads HF and opd_jax/Orbax teachers
straight into the mesh's NamedShardings, the sharded scoring forward equals the unsharded
one, and the full-vocabulary objective runs its fused kernel vocab-parallel (V on
"tensor") with the same optimizer step as on one device."""
import functools

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from opd_jax import envs
from opd_jax import sharding as sh
from opd_jax.checkpoint import Checkpointer
from opd_jax.distributed import fetch
from opd_jax.models import ModelConfig, save_pretrained, synthetic_tokenizer
from opd_jax.teachers import TeacherBank, TeacherScorer, teacher_fields
from opd_jax.episodes import Episode, encode
from opd_jax.trainers.objectives import VocabParallel, make_objective
from opd_jax.teachers.scoring import teacher_outputs
from opd_jax.losses import teacher_topk
from opd_jax.trainers.policy import policy_step
from opd_jax.episodes.sequences import build_sequences
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state
from tests.models.helpers import random_model

V = 128                                   # the synthetic tokenizer's vocabulary
STUDENT = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)
HF_TEACHER = STUDENT.replace(hidden_size=24)                          # untied lm_head
ORBAX_TEACHER = STUDENT.replace(hidden_size=32, tie_embeddings=True)  # unembedding = embed.T


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    save_pretrained(random_model(HF_TEACHER, seed=1), root / "hf")
    # An opd_jax run's checkpoint: a TrainState with the model config in its meta.
    _, state = create_state(random_model(ORBAX_TEACHER, seed=2), _optimizer())
    ckpt = Checkpointer(root / "run" / "checkpoints", async_save=False)
    ckpt.save(1, state, None, {"model": ORBAX_TEACHER.to_dict()})
    ckpt.close()
    return {"hf": str(root / "hf"), "orbax": str(root / "run")}


def _optimizer(name="adamw", lr=1e-2):
    return make_optimizer(ml_collections.ConfigDict(dict(
        name=name, lr=lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01,
        schedule="constant", warmup_steps=0, min_lr_ratio=0.1, grad_clip=1.0)), 3)


def _episodes(n: int):
    tok = synthetic_tokenizer()
    rng = np.random.default_rng(0)
    tasks = list(envs.TaskSource("arithmetic", size=n, seed=0))
    eps = [Episode(t, [tok.bos_token_id] + encode(tok, envs.render_prompt(t)),
                   response_ids=[int(x) for x in rng.integers(3, 100, size=k)])
           for t, k in zip(tasks, rng.integers(1, 7, size=n))]
    seqs = build_sequences([e.prompt_ids for e in eps], [e.response_ids for e in eps])
    return tok, eps, seqs


def test_bank_places_teachers_on_the_mesh(paths):
    mesh = sh.make_mesh((2, 2, 2))
    bank, plain = TeacherBank(paths, mesh=mesh), TeacherBank(paths)
    for key, cfg in (("hf", HF_TEACHER), ("orbax", ORBAX_TEACHER)):
        state = nnx.state(bank.get(key))
        want = sh.state_shardings(state, mesh)
        got = jax.tree.map(lambda x: x.sharding, state)
        assert jax.tree.leaves(got) == jax.tree.leaves(want), key
        specs = {tuple(s.spec) for s in jax.tree.leaves(got)}
        assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in jax.tree.leaves(got))
        assert ("tensor", "fsdp") in specs, (key, specs)         # the embedding [V, D]
        # Same values as the unsharded load.
        ref = nnx.state(plain.get(key))
        for a, b in zip(jax.tree.leaves(fetch(state)), jax.tree.leaves(fetch(ref))):
            np.testing.assert_array_equal(a, b)
        assert bank.get(key).config.hidden_size == cfg.hidden_size


@pytest.mark.parametrize("kind", ["logp", "hidden"])
def test_sharded_scores_equal_unsharded(paths, kind):
    """12 rows, 9 routed to the HF teacher and 3 to the Orbax one, chunks of 3 rows: on
    the (2, 2, 2) mesh the chunks grow to 4 (the batch shards; 3 chunks, the last padded),
    and the padding rows are dropped."""
    tok, eps, seqs = _episodes(12)
    weights = [{"orbax": 1.0} if b % 4 == 0 else {"hf": 1.0} for b in range(12)]
    mesh = sh.make_mesh((2, 2, 2))
    got = TeacherScorer(TeacherBank(paths, mesh=mesh), tok, kind, chunk_rows=3)
    assert got._chunk(9) == 4 and got._chunk(3) == 4
    ref = TeacherScorer(TeacherBank(paths), tok, kind, chunk_rows=3)
    scored, expected = got(eps, weights, seqs), ref(eps, weights, seqs)
    assert sorted(scored) == ["hf", "orbax"]
    for key in scored:
        rows, vals, unemb = scored[key]
        assert rows == expected[key][0] == [b for b in range(12) if key in weights[b]]
        assert vals.sharding == sh.batch_sharding(mesh, vals.ndim), key
        np.testing.assert_allclose(np.asarray(vals), np.asarray(expected[key][1]),
                                   rtol=1e-5, atol=1e-5)
        if kind == "hidden":
            np.testing.assert_array_equal(np.asarray(unemb), np.asarray(expected[key][2]))
    # The reference itself against the teacher run on the student's rows directly.
    m = seqs["mask"].astype(bool)
    teacher = TeacherBank(paths).get("hf")
    g, p, r = nnx.split(teacher, nnx.Param, ...)
    direct = np.asarray(teacher_outputs(p, r, seqs, graphdef=g, kind=kind))
    rows = scored["hf"][0]
    np.testing.assert_allclose(np.asarray(scored["hf"][1])[rows][m[rows]],
                               direct[rows][m[rows]], rtol=1e-5, atol=1e-5)
    # The batch fields built from them: equal too, and still global arrays on the mesh.
    fields = teacher_fields(scored, weights, kind).fields
    ref_fields = teacher_fields(expected, weights, kind).fields
    for name in fields:
        for a, b in zip(jax.tree.leaves(fields[name]), jax.tree.leaves(ref_fields[name])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    if kind == "logp":
        assert fields["teacher_logp"].sharding.mesh == mesh
    with pytest.raises(ValueError, match="teacher scoring of 10 student rows on mesh .* "
                                         "expected a multiple of its 4 batch shards"):
        got(eps[:10], weights[:10], {k: v[:10] for k, v in seqs.items()})


def test_sharded_topk_scores_equal_unsharded_and_the_teacher_run_directly(paths):
    """The top-k signal (ids and log-probs at the objective's temperature) through the
    same routing, chunking and alignment: on the (2, 2, 2) mesh equal to the unsharded
    scorer, both equal to the teacher's own top-k of its logits on the student's rows;
    the batch fields take each row from its teacher (id 0 / log-prob 0 on no row here)."""
    tok, eps, seqs = _episodes(12)
    weights = [{"orbax": 1.0} if b % 4 == 0 else {"hf": 1.0} for b in range(12)]
    mesh = sh.make_mesh((2, 2, 2))
    kw = dict(chunk_rows=3, top_k=5, temperature=0.7)
    got = TeacherScorer(TeacherBank(paths, mesh=mesh), tok, "topk", **kw)
    ref = TeacherScorer(TeacherBank(paths), tok, "topk", **kw)
    scored, expected = got(eps, weights, seqs), ref(eps, weights, seqs)
    m = seqs["mask"].astype(bool)
    fields = teacher_fields(scored, weights, "topk").fields
    for key in ("hf", "orbax"):
        rows, (ids, lq), unemb = scored[key]
        assert unemb is None and ids.dtype == np.int32 and ids.shape == (12, m.shape[1], 5)
        assert ids.sharding == sh.batch_sharding(mesh, 3), key
        np.testing.assert_array_equal(np.asarray(ids)[rows][m[rows]],
                                      np.asarray(expected[key][1][0])[rows][m[rows]])
        np.testing.assert_allclose(np.asarray(lq), np.asarray(expected[key][1][1]),
                                   rtol=1e-5, atol=1e-5)
        teacher = TeacherBank(paths).get(key)
        logits = teacher(seqs["inputs"], segment_ids_BxT=seqs["segment_ids"])
        want_ids, want_lq = teacher_topk(logits, 5, 0.7)
        np.testing.assert_array_equal(np.asarray(ids)[rows][m[rows]],
                                      np.asarray(want_ids)[rows][m[rows]])
        np.testing.assert_allclose(np.asarray(lq)[rows][m[rows]],
                                   np.asarray(want_lq)[rows][m[rows]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(fields["teacher_topk_ids"])[rows],
                                      np.asarray(ids)[rows])
    assert fields["teacher_topk_ids"].dtype == np.int32
    np.testing.assert_array_equal(fields["teacher_onehot"].sum(1), 1.0)
    with pytest.raises(ValueError, match="top_k=0"):
        TeacherScorer(TeacherBank(paths), tok, "topk")


def test_confidence_weights_on_the_mesh_equal_the_whole_batch(paths):
    """Confidence weighting (NeMo-RL's review found weights computed per data-parallel
    rank): the per-token weights from the sharded scorer's entropies on the (2, 2, 2) mesh
    equal those of the unsharded one, sum to 1 per token, and follow the entropies (the
    teacher with the lower entropy at a token weighs more there)."""
    tok, eps, seqs = _episodes(8)
    weights = [{"hf": 0.5, "orbax": 0.5}] * 8
    mesh = sh.make_mesh((2, 2, 2))
    kw = dict(chunk_rows=4, temperature=1.0, entropy=True)
    sharded = TeacherScorer(TeacherBank(paths, mesh=mesh), tok, "hidden", **kw)(
        eps, weights, seqs)
    whole = TeacherScorer(TeacherBank(paths), tok, "hidden", **kw)(eps, weights, seqs)
    f_s = teacher_fields(sharded, weights, "hidden", confidence=0.5).fields
    f_w = teacher_fields(whole, weights, "hidden", confidence=0.5).fields
    w_s, w_w = np.asarray(f_s["teacher_weights"]), np.asarray(f_w["teacher_weights"])
    assert w_s.shape == (8, seqs["mask"].shape[1], 2)
    assert f_s["teacher_weights"].sharding.mesh == mesh
    np.testing.assert_allclose(w_s, w_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w_s.sum(-1), 1.0, rtol=1e-6)
    order = teacher_fields(whole, weights, "hidden", confidence=0.5).order
    H = np.stack([np.asarray(whole[k][1][1]) for k in order])       # [S, B, T]
    m = seqs["mask"].astype(bool)
    apart = (np.abs(H[0] - H[1]) > 1e-4) & m
    assert apart.any()
    np.testing.assert_array_equal((w_w[..., 0] > 0.5)[apart], (H[0] < H[1])[apart])


def _full_vocab_step(mesh, spy_calls):
    """One deepseek_full_vocab policy step on `mesh` (2 teachers of widths 24 and 32,
    rows routed between them); (params after the step, metrics, the objective)."""
    rng = np.random.default_rng(0)
    B, T = 8, 12
    mask = (rng.random((B, T)) < 0.8).astype(np.int32)
    mask[:, :3] = 0
    host = {"inputs": rng.integers(0, V, (B, T)).astype(np.int32),
            "targets": rng.integers(0, V, (B, T)).astype(np.int32),
            "segment_ids": np.ones((B, T), np.int32), "mask": mask}
    onehot = np.zeros((B, 2), np.float32)
    onehot[np.arange(B), rng.integers(0, 2, B)] = 1.0
    teachers = [random_model(HF_TEACHER, seed=3), random_model(ORBAX_TEACHER, seed=4)]
    hidden = []
    for s, t in enumerate(teachers):
        g, p, r = nnx.split(t, nnx.Param, ...)
        h = np.asarray(teacher_outputs(p, r, host, graphdef=g, kind="hidden"))
        hidden.append(h * onehot[:, s, None, None])
    objective = make_objective("deepseek_full_vocab", implementation="xla")
    needs = type(objective).needs
    objective = needs.on_mesh(objective, mesh, sh.DEFAULT_RULES, V)
    # SGD: the parameter change is lr x the gradient. (Adam's first step is lr x g / |g|,
    # which turns fp32 rounding in a near-zero gradient entry into a full-size difference.)
    tx = _optimizer("sgd", lr=0.5)
    graphdef, state = create_state(random_model(STUDENT, seed=0), tx)
    state, shardings = place_state(state, mesh)
    step = compile_step(functools.partial(policy_step, graphdef=graphdef, tx=tx,
                                          objective=objective),
                        shardings, mesh,
                        extra_shardings=((needs.unembedding_sharding(objective, mesh),) * 2,))
    batch = sh.shard_batch(host | {"teacher_hidden": tuple(hidden), "teacher_weights": onehot},
                           mesh)
    before = len(spy_calls)
    state, metrics = step(state, batch, tuple(t.unembedding() for t in teachers))
    return fetch(state.params), fetch(metrics), objective, len(spy_calls) - before


def test_full_vocab_step_vocab_parallel_equals_unsharded(monkeypatch):
    from pallas_kernels import sharded
    calls = []
    original = sharded.fused_sharded

    def spy(*args):
        calls.append(args[-1])              # the Layout
        return original(*args)
    monkeypatch.setattr(sharded, "fused_sharded", spy)

    mesh = sh.make_mesh((2, 2, 2))
    got, m_got, obj, n_sharded = _full_vocab_step(mesh, calls)
    assert obj.vocab_parallel == VocabParallel(mesh, "tensor", ("data", "fsdp"))
    assert n_sharded == 2                     # one kernel call per teacher slot, traced once
    assert all(c.vocab_axis == "tensor" and c.token_axis == ("data", "fsdp") for c in calls)
    one = sh.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    ref, m_ref, obj1, n_one = _full_vocab_step(one, calls)
    assert obj1.vocab_parallel is None and n_one == 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    assert m_got["teacher/kl"].shape == (2,)          # one value per teacher slot
    for k in ("loss", "reverse_kl", "teacher/kl", "grad_norm"):
        np.testing.assert_allclose(m_got[k], m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The step changed the parameters (the comparison is not of two copies of the init).
    init = jax.tree.leaves(nnx.state(random_model(STUDENT, seed=0), nnx.Param))
    assert max(float(np.max(np.abs(a - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(ref), init)) > 1e-4


def test_vocab_parallel_layout_and_errors():
    needs = make_objective("deepseek_full_vocab").needs
    obj = make_objective("deepseek_full_vocab")
    # tensor axis 1: unchanged, unembeddings replicated.
    mesh = sh.make_mesh((2, 4, 1))
    assert needs.on_mesh(obj, mesh, sh.DEFAULT_RULES, 30) is obj
    assert needs.unembedding_sharding(obj, mesh).spec == P()
    # tensor axis 4: V on "tensor", tokens on the batch axes.
    mesh = sh.make_mesh((2, 1, 4))
    bound = needs.on_mesh(obj, mesh, sh.DEFAULT_RULES, 128)
    assert bound.vocab_parallel.kernel_kw() == {"mesh": mesh, "vocab_axis": "tensor",
                                                "token_axis": "data"}
    assert needs.unembedding_sharding(bound, mesh).spec == P(None, "tensor")
    with pytest.raises(ValueError, match="objective 'deepseek_full_vocab' runs vocab-parallel "
                                         "over mesh axis 'tensor' of size 4 .* vocabulary "
                                         "V=30 is not divisible by 4"):
        needs.on_mesh(obj, mesh, sh.DEFAULT_RULES, 30)
    # Rules that do not split the vocabulary: no vocab-parallel kernel.
    rules = tuple((k, None if k == "vocab" else v) for k, v in sh.DEFAULT_RULES)
    assert needs.on_mesh(obj, mesh, rules, 30) is obj
    # Objectives without the declaration are never changed; the field is not an option.
    grpo = make_objective("grpo")
    assert type(grpo).needs.on_mesh(grpo, mesh, sh.DEFAULT_RULES, 30) is grpo
    assert type(grpo).needs.unembedding_sharding(grpo, mesh).spec == P()
    with pytest.raises(ValueError, match="vocab_parallel comes from the run's mesh"):
        make_objective("deepseek_full_vocab", vocab_parallel=None)


def test_train_policy_refuses_a_vocab_the_tensor_axis_does_not_divide(tmp_path):
    """Before anything is read, built or written."""
    import os

    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "opd_jax/configs/opd.py:deepseek_full_vocab"), [
        "--config.model.vocab_size=130", "--config.mesh.shape=(2, 1, 4)",
        "--config.teachers.paths={'general': '/not/read'}"])
    with pytest.raises(ValueError, match="objective 'deepseek_full_vocab' runs vocab-parallel "
                                         "over mesh axis 'tensor' of size 4 .*V=130 is not "
                                         "divisible by 4"):
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()
