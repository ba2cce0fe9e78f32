"""Scale-up presets: real-size stages are built, shape-checked and memory-estimated abstractly."""
import math
import os

import pytest

from opd_jax.config import load_config
from opd_jax.models import ModelConfig
from opd_jax.recipes import recipe_module
from studies import scale_estimate, scale_up

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS = [(r, p) for r in ("kimi_k3", "glm", "deepseek_v4") for p in scale_up.MESHES]


def _load(recipe, preset, *overrides):
    return load_config(os.path.join(ROOT, f"experiments/{recipe}/config.py:{preset}"),
                       list(overrides))


@pytest.fixture(scope="module")
def estimates():
    """Every preset's rows, once (the full-depth traces are tested separately)."""
    return {(r, p): scale_estimate.estimate(_load(r, p), trace=False) for r, p in PRESETS}


def test_sharded_bytes_split_over_fsdp():
    cfg = ModelConfig.preset("qwen3-1.7b")
    assert cfg.num_params() == pytest.approx(1.72e9, rel=0.01)     # Qwen3-1.7B
    per_device = scale_estimate.params_bytes(cfg, (4, 8, 1), scale_estimate.sh.DEFAULT_RULES)
    total = cfg.num_params() * 4
    # fsdp=8 shards every large matrix; only norms (tiny) stay replicated; data=4 replicates.
    assert total / 8 <= per_device <= total / 8 * 1.01


@pytest.mark.parametrize("recipe,preset", PRESETS)
def test_preset_builds_and_estimates(estimates, recipe, preset):
    c = _load(recipe, preset)
    mesh = scale_up.MESHES[preset]
    rows = estimates[(recipe, preset)]
    assert [r["stage"] for r in rows] == [s.name for s in scale_estimate.plan(c)]
    student = next(r for r in rows if r["stage"] == "student")
    assert student["model"].vocab_size == 151936
    assert student["model"].hidden_size == 2048 and student["model"].param_dtype == "float32"
    assert student["model"].dtype == "bfloat16"
    for r in rows:
        assert r["hbm_gib"] == mesh.hbm_gib
        numbers = [r["params"], r["peak"]]
        if r["kind"] != "merge":
            numbers += [r["grads"], r["optimizer"], r["activations"]["total"],
                        r["activations"]["attention"]]
            assert r["geometry"].micro >= 1 and r["geometry"].seq == scale_up.SEQ_LEN
            assert r["optimizer"] == pytest.approx(2 * r["params"], rel=1e-3)   # Adam mu, nu
        if r["kind"] in ("grpo", "opd"):
            # The scoring pass runs a minibatch of rows at a time, not the whole iteration.
            geo = r["geometry"]
            assert r["scoring"] == geo.micro * geo.seq * r["model"].vocab_size * 6
            assert geo.rows > geo.micro
        assert all(math.isfinite(x) and x > 0 for x in numbers), (r["stage"], numbers)
    # With remat="layer" every training stage fits at T = 4096 (the merges are not trained).
    trained = [r for r in rows if r["kind"] != "merge"]
    assert all(r["model"].remat == "layer" and r["fits"] for r in trained)
    assert all(r["max_seq"] >= scale_up.SEQ_LEN for r in trained)
    teachers = [r for r in rows if r["kind"] == "opd"]
    assert teachers and all(0 < r["n_loaded"] < r["n_teachers"] for r in teachers)
    if recipe != "glm":        # 8B teachers from their own SFT stage; the student stays 1.7B
        by = {r["stage"]: r for r in rows}
        assert by["teacher_sft"]["model"].hidden_size == 4096
        assert all(by[n]["model"].hidden_size == 4096 for n in by
                   if n.startswith("rl_"))
    md = scale_estimate.table(rows)
    assert f"| {mesh.hbm_gib:.0f} |" in md and "| student | opd | qwen3-1.7b |" in md


def test_same_config_same_numbers_on_both_meshes(estimates):
    """Both meshes shard params 8 ways (fsdp) with one row per device per micro-batch."""
    v5p, h100 = estimates[("kimi_k3", "scale_v5p64")], estimates[("kimi_k3", "scale_8xh100")]
    for a, b in zip(v5p, h100):
        assert a["peak"] == b["peak"] and a["hbm_gib"] > b["hbm_gib"]
    ds = {r["stage"]: r for r in estimates[("deepseek_v4", "scale_8xh100")]}
    # Same cache bound; the full-vocab student also holds the teachers' hidden states and
    # unembeddings, and builds no [T, V] logits of its own.
    assert ds["student"]["teacher_cache"] > ds["sampled_student"]["teacher_cache"]
    assert ds["student"]["activations"]["total"] < ds["sampled_student"]["activations"]["total"]


def test_remat_estimate_keeps_layer_inputs_and_recomputes_one_layer():
    """The estimate follows the stage's model.remat: with "layer" each layer adds only its
    bf16 [rows, T, D] input, and one layer's activations (its [H, T, T] attention too) are
    counted once, for its recomputation in the backward."""
    c = _load("glm", "scale_8xh100")
    stages = scale_estimate.plan(c)
    models = scale_estimate.stage_models(stages)
    student = next(s for s in stages if s.name == "student")
    mesh_shape, rules = tuple(student.config.mesh.shape), scale_estimate._rules(student.config)
    geo = scale_estimate.geometry(student, scale_estimate.abstract_mesh(mesh_shape))
    dims = tuple((0, 0) for _ in dict.fromkeys(student.teachers.values()))
    model = models["student"]
    L, T, D, H = model.num_layers, geo.seq, model.hidden_size, model.num_heads

    def act(m):
        return scale_estimate.activation_bytes("opd", scale_estimate._stage_key(student), m,
                                               geo.micro, T, dims, mesh_shape, rules)

    remat, plain = act(model), act(model.replace(remat="none"))
    deeper = act(model.replace(num_layers=L + 4))
    assert model.remat == "layer" and plain["recompute"] == 0
    assert deeper["total"] - remat["total"] == 4 * geo.micro * T * D * 2
    # Attention: every layer's without remat, one layer's with it (>= fp32 scores + probs).
    assert remat["attention"] == pytest.approx(plain["attention"] / L)
    assert remat["attention"] >= 2 * geo.micro * H * T * T * 4
    assert remat["recompute"] >= remat["attention"]
    # Without remat the stage does not fit the 80 GiB of an H100; with it, easily.
    assert plain["total"] > 80 * scale_estimate.GIB > 4 * remat["total"]


def test_traced_steps_compose():
    c = _load("deepseek_v4", "scale_8xh100")
    stages = scale_estimate.plan(c)
    models = scale_estimate.stage_models(stages)
    student = next(s for s in stages if s.name == "student")
    geo = scale_estimate.geometry(student, scale_estimate.abstract_mesh(student.config.mesh.shape))
    dims = tuple((models[ref].hidden_size, models[ref].vocab_size)
                 for ref in dict.fromkeys(student.teachers.values()))
    # Real widths, vocab and batch; 2 of the 28 (identical) layers to keep the test fast
    # (`python -m studies.scale_estimate` traces every stage at full depth).
    t = scale_estimate.trace_stage("opd", scale_estimate._stage_key(student),
                                   models["student"].replace(num_layers=2), geo.micro, geo.accum,
                                   geo.seq, dims)
    assert t["forward"] == f"hidden [{geo.micro}, {geo.seq}, 2048]"
    assert t["per_token"] == f"full-vocab reverse KL [{geo.micro * geo.seq}]"
    assert t["loss"] == []


def test_teacher_with_another_vocab_is_refused():
    c = _load("kimi_k3", "scale_8xh100", "--config.teacher_sft.model.vocab_size=152064",
              "--config.teacher.model.vocab_size=152064")
    with pytest.raises(ValueError, match="stage 'student': teacher '.*' \\(stage 'rl_.*'\\) has "
                                         "vocab_size 152064, expected the student's 151936"):
        scale_estimate.estimate(c, trace=False)
    # A stage whose model section disagrees with the checkpoint it starts from is refused too.
    c = _load("kimi_k3", "scale_8xh100", "--config.teacher.model.num_layers=28")
    with pytest.raises(ValueError, match="model section differs from stage 'teacher_sft'"):
        scale_estimate.estimate(c, trace=False)


def test_estimate_needs_a_scale_preset():
    with pytest.raises(ValueError, match="has no `scale` section"):
        scale_estimate.estimate(_load("glm", "smoke"))
    with pytest.raises(KeyError, match="scale preset 'scale_tpu'"):
        scale_up.apply_scale(_load("glm", "smoke").unlock(), "scale_tpu")


def test_tiny_presets_plans_unchanged():
    """The optional teacher cold start adds nothing unless c.teacher_sft is set."""
    k = recipe_module("kimi_k3").build(_load("kimi_k3", "reduced"), 0)
    assert [(s.name, s.init_from) for s in k] == [
        ("sft_coding", None), ("rl_coding_max", "sft_coding"),
        ("rl_coding_high", "rl_coding_max"), ("rl_coding_low", "rl_coding_high"),
        ("sft_general", None), ("rl_general_max", "sft_general"),
        ("rl_general_high", "rl_general_max"), ("rl_general_low", "rl_general_high"),
        ("merge_0.5", None), ("merge_1", None), ("merge_1.5", None), ("student", "merge_1")]
    d = recipe_module("deepseek_v4").build(_load("deepseek_v4", "reduced"), 0)
    assert [(s.name, s.init_from) for s in d] == [(s.name, s.init_from) for s in k] + [
        ("sampled_student", "merge_1"), ("mixed_sft", None), ("mixed", "mixed_sft")]
    scaled = {s.name: s for s in recipe_module("kimi_k3").build(_load("kimi_k3", "scale_v5p64"), 0)}
    assert scaled["rl_agent_max"].init_from == "teacher_sft"
    assert scaled["merge_1"].init_from == "teacher_sft" and scaled["student"].init_from == "sft"


def test_topk_student_estimates_and_traces():
    """A top-k student (`topk_distill`, K = 64) at real size: the teacher cache grows by K
    ids and log-probs per token, and the step traces with the [B, T, K] fields."""
    import ml_collections
    from opd_jax.trainers.objectives import default_options
    c = _load("kimi_k3", "scale_8xh100")
    c.student.objective = ml_collections.ConfigDict(dict(
        name="topk_distill", options=default_options("topk_distill", top_k=64)))
    rows = {r["stage"]: r for r in scale_estimate.estimate(c, trace=False)}
    assert rows["student"]["teacher_cache"] > 0
    stages = scale_estimate.plan(c)
    student = next(s for s in stages if s.name == "student")
    models = scale_estimate.stage_models(stages)
    geo = scale_estimate.geometry(student, scale_estimate.abstract_mesh(student.config.mesh.shape))
    t = scale_estimate.trace_stage("opd", scale_estimate._stage_key(student),
                                   models["student"].replace(num_layers=2), geo.micro, geo.accum,
                                   geo.seq, tuple((0, 0) for _ in set(student.teachers.values())))
    assert t["loss"] == []
