"""The three recipes at real sizes: presets, shape checks and a per-device memory estimate.

Presets ``scale_v5p64`` and ``scale_8xh100`` of ``experiments/{kimi_k3,glm,deepseek_v4}/
config.py`` are the same recipes at real size, made by :func:`apply_scale`: a Qwen3-1.7B
student line (SFT and OPD stages; bf16 compute, fp32 params), Qwen3-8B teachers for kimi_k3
and deepseek_v4 (their own 8B SFT stage "teacher_sft", then GRPO; GLM's teachers are its
own earlier 1.7B stages), V = 151,936, realistic batches, and the mesh of a TPU v5p-64
slice ((4, 8, 1) data x fsdp x tensor, 95 GiB HBM per chip) or of one 8xH100 node
((1, 8, 1), 80 GiB). Every trained stage's model has ``remat="layer"`` (ModelConfig: each
decoder layer's forward recomputed in the backward; without it no training stage fits at
T = 4096). They are compile-checked here, not run: paths such as ``/path/to/Qwen3-1.7B``
are placeholders for a local Hugging Face folder (config.json, tokenizer and safetensors)
that the real run must point to.

    python -m opd_jax.recipes.scale_up --config experiments/kimi_k3/config.py:scale_8xh100
    python -m opd_jax.recipes.scale_up        # every recipe x both meshes

For a config, :func:`estimate` builds the recipe's stages (``build(c, seed)``,
``check_stages``), resolves each stage's model (the stage it starts from, checked against
its own model section; teachers must share the student's vocabulary), and computes, from
that stage's own config and without allocating anything:

* params, gradients, optimizer state: the train state the trainer builds (``nnx.eval_shape``
  of the model, ``jax.eval_shape`` of the optimizer's init), each leaf sharded by the
  config's logical-axis rules on an ``AbstractMesh`` of the config's ``mesh.shape``
  (per-device bytes of the largest shard). SFT with ``grad_accum > 1`` holds two gradient
  trees (the accumulator and the micro-batch's).
* activations of one micro-batch per device (SFT: ``batch_size / batch devices /
  grad_accum`` rows; RL/OPD: ``prompts_per_step x group_size / minibatches / batch devices``):
  the residuals autodiff saves for the backward pass, traced from the stage's real loss
  (``jax.ad_checkpoint`` saved residuals of ``sft_micro_loss`` or the stage's objective,
  under the stage's ``model.remat``) at depth 1 and 2 and extrapolated over the L layers
  (the layers are identical): ``saved = d1 + (L - 1) (d2 - d1)``. Without remat that is
  every layer's activations. With remat it is one [rows, T, D] input per layer plus what
  lies outside the layers (embedding, final norm, logits), and the backward recomputes one
  layer at a time, so one layer's activations are live again on top: ``recompute =
  (n2 - n1) - (d2 - d1)``, with n1, n2 the same loss's residuals without remat. Then the
  largest residual once more for the backward's working gradient (the [rows, T, V] fp32
  log-softmax where logits are built): ``activations = saved + recompute + largest``. This
  is an upper bound: the logits' working gradient is freed before the layers' backward
  starts. bf16 weight copies count at their sharded size. The ``attn`` share is the [H, T, T]
  scores, probabilities and mask of the model's plain (non-flash) attention: every layer's
  without remat, one layer's (the recomputed one) with it; it grows as T^2. Check against
  XLA (no remat): for Qwen3-1.7B widths (vocab 8192, one row) the CPU backend's compiled
  temp memory grew by 456 / 1209 MiB per layer at T = 1024 / 2048, against 482 / 1221 MiB
  of residuals counted this way (TPU and GPU fuse differently). The CPU backend cannot check
  the remat numbers: XLA:CPU drops the optimization barriers that keep the recomputation in
  the backward and schedules it next to the forward, so its temp memory still grows by
  389 MiB per layer at T = 1024 with remat (409 without); TPU and GPU keep the barriers.
* teacher cache: ``teachers.max_loaded`` (0: all) teachers in bf16, sharded like the student;
  for the full-vocab objective also the cached teacher hidden states of one iteration's
  rows per device ([rows, T, E] bf16 per teacher) and the teachers' [E, V] unembeddings,
  replicated, as the trainer passes them to the step.
* scoring: the no-grad forward that recomputes the old log-probs (and, for sampled-token
  OPD, the teachers', one after the other). The trainer runs it one minibatch of rows at a
  time (``run_policy.in_row_chunks``), so it holds one forward-backward's rows per device:
  [micro, T, V] logits in bf16 plus their fp32 log-softmax. It does not overlap the
  backward, so the peak is max(params + grads + optimizer + activations + cache,
  params + optimizer + cache + scoring).
* merge stages: every merged model plus the base and the result, unsharded on one device
  (as ``teachers.merge_models`` runs).

The table has one row per distinct stage: ``rows/dev`` is one device's rows per SFT
optimizer step or per RL/OPD iteration, ``(micro)`` per forward-backward; ``fits up to T``
solves the same numbers for the longest row length (a multiple of 256) that fits the HBM
with the same rows (attention as T^2, the other activations, scoring and teacher outputs
as T).

Every distinct stage (kind, model, objective, shapes) is also traced at full depth with
``jax.eval_shape``: one forward, the per-token quantity of its loss (token log-probs for SFT
and sampled-token stages; the fused full-vocab reverse KL for the full-vocab student) and the
whole train step (loss, gradients, optimizer update), for one device's share of the batch;
the step must return a state of the same shapes.

Not estimated: the rollout phase (the sampler's KV cache), tensor-parallel splitting of
activations (both meshes have tensor = 1), and XLA's own temporaries. What the code does
today that the estimate assumes otherwise: ``TeacherBank`` loads a teacher unsharded and in
its checkpoint's param dtype (fp32 for opd_jax runs), and the teacher scorer runs it on one
device; the estimate counts teachers as bf16 and sharded, as a run at this size would need.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from opd_jax import sharding as sh
from opd_jax.models import ModelConfig, Transformer

GIB = 1024 ** 3
_HERE = os.path.basename(__file__)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    name: str
    shape: tuple[int, int, int]          # (data, fsdp, tensor)
    hbm_gib: float


MESHES = {"scale_v5p64": MeshSpec("tpu-v5p-64", (4, 8, 1), 95.0),
          "scale_8xh100": MeshSpec("8xH100", (1, 8, 1), 80.0)}
STUDENT, TEACHER = "qwen3-1.7b", "qwen3-8b"
# Placeholders for local Hugging Face folders (config.json, tokenizer, safetensors).
CHECKPOINTS = {STUDENT: "/path/to/Qwen3-1.7B", TEACHER: "/path/to/Qwen3-8B"}
# recipe -> its trainer-config sections: (section, role, model preset)
SECTIONS = {
    "kimi_k3": (("sft", "sft", STUDENT), ("teacher_sft", "sft", TEACHER),
                ("teacher", "rl", TEACHER), ("student", "opd", STUDENT)),
    "glm": (("sft", "sft", STUDENT), ("rl", "rl", STUDENT), ("student", "opd", STUDENT)),
    "deepseek_v4": (("sft", "sft", STUDENT), ("teacher_sft", "sft", TEACHER),
                    ("specialist", "rl", TEACHER), ("student", "opd", STUDENT),
                    ("sampled_student", "opd", STUDENT)),
}
# Global sizes per mesh: SFT sequences per step, GRPO prompts per iteration (x GROUP samples),
# OPD prompts per iteration (one sample each). Micro-batches are MICRO_ROWS rows per device.
SIZES = {"tpu-v5p-64": dict(sft_batch=128, rl_prompts=64, opd_prompts=256),
         "8xH100": dict(sft_batch=32, rl_prompts=16, opd_prompts=64)}
SEQ_LEN = 4096          # SFT packed length; RL/OPD rollout row length (prompt + all turns)
MAX_NEW_TOKENS = 3072   # per sampled turn
GROUP = 8               # GRPO samples per prompt
MICRO_ROWS = 1          # rows per device per micro-batch
REMAT = "layer"         # model.remat of every trained stage: each layer recomputed in the backward
MAX_LOADED = {"kimi_k3": 4, "glm": 2, "deepseek_v4": 2}     # < the bank: 9, 3, 4 teachers


def _set_model(m: ml_collections.ConfigDict, preset: str, init_from: str) -> None:
    fields = ModelConfig.preset(preset, dtype="bfloat16", param_dtype="float32",
                                remat=REMAT).to_dict()
    m.update({k: v for k, v in fields.items() if v is not None})
    m.init_from = init_from


def apply_scale(c: ml_collections.ConfigDict, preset: str) -> ml_collections.ConfigDict:
    """Turn a recipe config (any preset) into its real-size `preset` (a key of MESHES), in place.

    Every stage's model section gets the real architecture (the SFT stages start from the
    Hugging Face folders of CHECKPOINTS, placeholders) and ``remat=REMAT``, batches split
    into MICRO_ROWS-row micro-batches per device (SFT: ``optim.grad_accum``; RL/OPD:
    ``rl.minibatches``, each an optimizer step), teacher caches are bounded below the bank,
    and ``c.scale`` records the mesh and its HBM for :func:`estimate`. kimi_k3 and
    deepseek_v4 get ``c.teacher_sft``, an 8B copy of the SFT stage their teachers start from.
    """
    if preset not in MESHES:
        raise KeyError(f"scale preset {preset!r}: expected one of {sorted(MESHES)}")
    if c.recipe not in SECTIONS:
        raise ValueError(f"recipe {c.recipe!r} has no scale-up sections; expected one of "
                         f"{sorted(SECTIONS)}")
    mesh = MESHES[preset]
    sizes = SIZES[mesh.name]
    batch_devices = mesh.shape[0] * mesh.shape[1]      # the "batch" rule: (data, fsdp)
    rows_per_micro = batch_devices * MICRO_ROWS
    c.seeds = (0,)
    c.tokenizer = CHECKPOINTS[STUDENT]     # Qwen3 1.7B and 8B share one tokenizer
    c.scale = ml_collections.ConfigDict(dict(preset=preset, mesh=mesh.name,
                                             hbm_gib=mesh.hbm_gib))
    if any(section == "teacher_sft" for section, _, _ in SECTIONS[c.recipe]):
        c.teacher_sft = ml_collections.ConfigDict(c.sft.to_dict())
    for section, role, model in SECTIONS[c.recipe]:
        s = c[section]
        _set_model(s.model, model, CHECKPOINTS[model] if role == "sft" else "")
        s.tokenizer = CHECKPOINTS[STUDENT]
        s.mesh.shape = mesh.shape
        s.train.ckpt_every = 20
        if role == "sft":
            s.data.update(dict(seq_len=SEQ_LEN, batch_size=sizes["sft_batch"], packing=True))
            s.optim.update(dict(lr=1e-5, warmup_steps=100, grad_accum=sizes["sft_batch"] //
                                rows_per_micro))
            s.train.update(dict(steps=2000, ckpt_every=200))
            continue
        group = GROUP if role == "rl" else 1
        prompts = sizes["rl_prompts" if role == "rl" else "opd_prompts"]
        s.rollout.update(dict(prompts_per_step=prompts, group_size=group, seq_len=SEQ_LEN))
        s.rollout.sampling.max_new_tokens = MAX_NEW_TOKENS
        s.rl.minibatches = prompts * group // rows_per_micro
        s.optim.update(dict(lr=1e-6, warmup_steps=10))
        s.train.steps = 200
        s.eval.update(dict(every=20, n=256, batch_size=256))
        s.eval.sampling.max_new_tokens = MAX_NEW_TOKENS
        if role == "opd":
            s.teachers.max_loaded = MAX_LOADED[c.recipe]
    c.eval.update(dict(n=256, batch_size=256))
    c.eval.sampling.max_new_tokens = MAX_NEW_TOKENS
    return c


# ----------------------------------------------------------------------------- the estimate

def abstract_mesh(shape) -> AbstractMesh:
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(sh.MESH_AXES) or min(shape) < 1:
        raise ValueError(f"mesh shape {shape}: expected {len(sh.MESH_AXES)} positive sizes "
                         f"for axes {sh.MESH_AXES} (no -1: the estimate needs the real mesh)")
    return AbstractMesh(shape, sh.MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def _rules(cfg) -> tuple:
    return tuple(tuple(r) for r in cfg.mesh.rules)


@functools.lru_cache(maxsize=None)
def abstract_model(config: ModelConfig) -> nnx.Module:
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def _value(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def per_device_bytes(tree, mesh: AbstractMesh, rules=sh.DEFAULT_RULES) -> int:
    """Bytes of the largest per-device shard of `tree` (abstract arrays / nnx Variables),
    each leaf placed by its logical names and the rules (unnamed leaves replicated)."""
    shardings = sh.state_shardings(tree, mesh, rules)
    is_var = lambda x: isinstance(x, nnx.Variable)
    leaves = jax.tree.leaves(tree, is_leaf=is_var)
    specs = jax.tree.leaves(shardings, is_leaf=is_var)
    if len(leaves) != len(specs):
        raise AssertionError(f"{len(leaves)} leaves but {len(specs)} shardings")
    total = 0
    for leaf, spec in zip(leaves, specs):
        x, s = _value(leaf), _value(spec)
        total += math.prod(s.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize
    return total


def _canonical(config: ModelConfig) -> ModelConfig:
    """One abstract model per architecture (dtypes and remat change no shape or sharding)."""
    return config.replace(dtype="bfloat16", param_dtype="float32", remat="none")


@functools.lru_cache(maxsize=None)
def _param_elements(config: ModelConfig, mesh_shape: tuple, rules: tuple) -> int:
    _, params, _ = nnx.split(abstract_model(config), nnx.Param, ...)
    return per_device_bytes(params, abstract_mesh(mesh_shape), rules) // 4


def params_bytes(config: ModelConfig, mesh_shape: tuple, rules: tuple) -> int:
    """Per-device bytes of a model's params in its param dtype."""
    return (_param_elements(_canonical(config), tuple(mesh_shape), rules)
            * jnp.dtype(config.param_dtype).itemsize)


@functools.lru_cache(maxsize=None)
def optimizer_bytes(config: ModelConfig, optim_key: str, mesh_shape: tuple, rules: tuple) -> int:
    """Per-device bytes of the optimizer state the trainer's optimizer keeps for the params."""
    from opd_jax.trainers.state import make_optimizer
    tx = make_optimizer(ml_collections.ConfigDict(json.loads(optim_key)), 100)
    _, params, _ = nnx.split(abstract_model(config), nnx.Param, ...)
    return per_device_bytes(jax.eval_shape(tx.init, params), abstract_mesh(mesh_shape), rules)


def stage_models(stages) -> dict[str, ModelConfig]:
    """Each stage's model: its own section, or (init_from) the model of the stage it starts
    from, which must have the same architecture as the section (the runtime reads the
    checkpoint's; a differing section would be silently ignored). Teachers and merged
    models must share the student's vocabulary / the base's architecture."""
    from opd_jax.trainers.builders import model_config_from
    models: dict[str, ModelConfig] = {}
    for s in stages:
        if s.kind == "merge":
            keys = sorted(s.teachers)
            refs = [s.teachers[k] for k in keys] + ([s.init_from] if s.init_from else [])
            base = models[refs[-1]]
            want = base.architecture()
            for ref in refs:
                got = models[ref].architecture()
                if got != want:
                    diff = sorted(k for k, v in want.items() if got[k] != v)
                    raise ValueError(f"stage {s.name!r}: merges stage {ref!r} whose model differs "
                                     f"from {refs[-1]!r} in {diff}; expected one architecture")
            models[s.name] = base
            continue
        own = model_config_from(s.config.model)
        if s.init_from:
            parent = models[s.init_from]
            have, want = parent.architecture(), own.architecture()
            if have != want:
                diff = ", ".join(f"{k}={v} (stage {s.init_from!r}: {have[k]})"
                                 for k, v in want.items() if have[k] != v)
                raise ValueError(f"stage {s.name!r}: model section differs from stage "
                                 f"{s.init_from!r} it starts from: {diff}; expected the same "
                                 f"architecture (the run loads that stage's checkpoint)")
            # Params keep the checkpoint's dtype; compute dtype and remat are the section's.
            own = parent.replace(dtype=own.dtype, remat=own.remat)
        for key, ref in s.teachers.items():
            if s.kind == "opd" and models[ref].vocab_size != own.vocab_size:
                raise ValueError(f"stage {s.name!r}: teacher {key!r} (stage {ref!r}) has "
                                 f"vocab_size {models[ref].vocab_size}, expected the student's "
                                 f"{own.vocab_size} (OPD compares distributions over one "
                                 f"vocabulary)")
        models[s.name] = own
    return models


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One device's share of a stage's batch."""
    rows: int           # rows per device per optimizer step (SFT) / per iteration (RL, OPD)
    micro: int          # rows per device per forward-backward
    seq: int            # T
    accum: int          # SFT micro-batches per optimizer step; RL/OPD minibatches


def geometry(stage, mesh: AbstractMesh) -> Geometry:
    """Per-device rows, checked the way the trainers check them (before any work)."""
    cfg = stage.config
    devices = sh.batch_shards(mesh, _rules(cfg))
    if stage.kind == "sft":
        B, accum, T = cfg.data.batch_size, cfg.optim.grad_accum, cfg.data.seq_len
        if B % (devices * accum):
            raise ValueError(f"stage {stage.name!r}: data.batch_size={B} must split into "
                             f"optim.grad_accum={accum} micro-batches over {devices} batch "
                             f"devices; expected a multiple of {devices * accum}")
        return Geometry(B // devices, B // devices // accum, T, accum)
    from opd_jax.trainers.builders import policy_rows
    try:
        rows = policy_rows(cfg, devices)
    except ValueError as e:
        raise ValueError(f"stage {stage.name!r}: {e}") from None
    mb, T = cfg.rl.minibatches, cfg.rollout.seq_len
    if T <= 0:
        raise ValueError(f"stage {stage.name!r}: rollout.seq_len={T} (bucketed per batch); "
                         f"expected a fixed positive length to estimate memory at")
    return Geometry(rows // devices, rows // devices // mb, T, mb)


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _batch(kind: str, objective: str | None, rows: int, T: int, teacher_dims: tuple,
           teacher_dtype: str) -> tuple[dict, tuple]:
    """An abstract batch (and teacher unembeddings) with every key the stage's step reads."""
    i32, f32 = (lambda: _sds((rows, T), jnp.int32)), (lambda: _sds((rows, T), jnp.float32))
    batch = dict(inputs=i32(), targets=i32(), mask=i32(), segment_ids=i32())
    if kind == "sft":
        return batch | dict(positions=i32()), ()
    batch |= dict(sampler_logp=f32(), old_logp=f32(), adv=_sds((rows,), jnp.float32))
    S = len(teacher_dims)
    if objective == "deepseek_full_vocab":
        batch |= dict(teacher_hidden=tuple(_sds((rows, T, E), teacher_dtype)
                                           for E, _ in teacher_dims),
                      teacher_weights=_sds((rows, S), jnp.float32))
        return batch, tuple(_sds((E, V), teacher_dtype) for E, V in teacher_dims)
    if objective != "grpo":
        batch |= dict(teacher_logp=f32(), teacher_onehot=_sds((rows, S), jnp.float32))
    return batch, ()


def _loss_fn(kind: str, stage_key: str):
    """(params, rest, batch, teachers) -> scalar loss of one micro-batch, as the trainer's."""
    from opd_jax.trainers.objectives import make_objective
    from opd_jax.trainers.sft import sft_micro_loss
    spec = json.loads(stage_key)
    if kind == "sft":
        return lambda g, p, r, b, t: sft_micro_loss(p, r, g, b, 1.0)[0]
    objective = make_objective(spec["objective"]["name"], **spec["objective"]["options"])
    return lambda g, p, r, b, t: objective(nnx.merge(g, p, r), b, t)[0]


def _stage_key(stage) -> str:
    """JSON of the config parts that decide a stage's step (objective, optimizer)."""
    cfg = stage.config
    out = {"optim": cfg.optim.to_dict()}
    if stage.kind != "sft":
        out["objective"] = cfg.objective.to_dict()
        out["objective"]["options"] = {k: list(v) if isinstance(v, tuple) else v
                                       for k, v in out["objective"]["options"].items()}
    return json.dumps(out, sort_keys=True, default=str)


_KINDS = ("weights", "attention", "other")


@functools.lru_cache(maxsize=None)
def _residuals(kind: str, stage_key: str, config: ModelConfig, micro: int, T: int,
               teacher_dims: tuple, mesh_shape: tuple, rules: tuple) -> tuple[dict, dict]:
    """Per-device saved residuals of one micro-batch's loss at depth 1 and 2, by kind
    (weights / attention / other), with the largest one and its kind."""
    # The function behind the public jax.ad_checkpoint.print_saved_residuals.
    from jax._src.ad_checkpoint import saved_residuals
    mesh = abstract_mesh(mesh_shape)
    objective = json.loads(stage_key).get("objective", {}).get("name")
    loss = _loss_fn(kind, stage_key)
    out = []
    for depth in (1, 2):
        cfg = config.replace(num_layers=depth)
        graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
        # Per-device fraction of each param shape (bf16 copies of weights are residuals too).
        frac = {}
        for path, var in nnx.to_flat_state(params):
            shape = tuple(_value(var).shape)
            spec = NamedSharding(mesh, sh._divisible_spec(
                sh.logical_to_spec(sh._logical_names(var), rules, mesh), shape, mesh))
            f = math.prod(spec.shard_shape(shape)) / math.prod(shape)
            frac.setdefault(shape, f)
            frac.setdefault(shape[::-1], f)         # transposed (the tied unembedding)
        batch, teachers = _batch(kind, objective, micro, T, teacher_dims, "bfloat16")

        def f(params, rest, batch, teachers):
            sg = jax.lax.stop_gradient
            return loss(graphdef, params, sg(rest), jax.tree.map(sg, batch),
                        jax.tree.map(sg, teachers))

        acc = {"weights": 0.0, "attention": 0.0, "other": 0.0, "largest": 0.0,
               "largest_kind": "other"}
        for aval, where in saved_residuals(f, params, rest, batch, teachers):
            if (where.startswith("from the argument") or not hasattr(aval, "shape")
                    or ("stop_gradient" in where and _HERE in where)):
                continue                # inputs (batch, teachers): counted in their columns
            shape = tuple(aval.shape)
            n = math.prod(shape) * jnp.dtype(aval.dtype).itemsize
            if shape in frac and ("convert_element_type" in where or "transpose" in where):
                acc["weights"] += n * frac[shape]
            else:
                kind_ = "attention" if len(shape) >= 4 and shape[-2:] == (T, T) else "other"
                acc[kind_] += n
                if n > acc["largest"]:
                    acc["largest"], acc["largest_kind"] = n, kind_
        out.append(acc)
    return tuple(out)


def activation_bytes(kind: str, stage_key: str, config: ModelConfig, micro: int, T: int,
                     teacher_dims: tuple, mesh_shape: tuple, rules: tuple) -> dict:
    """Activation bytes of one micro-batch's backward pass, by kind (module doc).

    saved = d1 + (L - 1) (d2 - d1), the residuals of the loss at depth 1 and 2 (d1, d2)
    extrapolated over the L identical layers. Without remat that is every layer's
    activations. With ``config.remat`` it is each layer's input (plus, for "dots", its
    matmul outputs) and the backward recomputes one layer at a time, so it also holds one
    layer's activations: recompute = (n2 - n1) - (d2 - d1), with n1, n2 the residuals of
    the same loss without remat (one layer's residuals less what the remat'd layer keeps
    anyway). Then + the largest residual of the no-remat trace again, the backward's working
    gradient of it: total = saved + recompute + largest.
    """
    args = (kind, stage_key, config, micro, T, teacher_dims, mesh_shape, rules)
    d1, d2 = _residuals(*args)
    L = config.num_layers
    res = {k: d1[k] + (L - 1) * (d2[k] - d1[k]) for k in _KINDS}
    res["recompute"] = 0.0
    n1, n2 = d1, d2
    if config.remat != "none":
        n1, n2 = _residuals(kind, stage_key, config.replace(remat="none"), *args[3:])
        for k in _KINDS:
            layer = max(0.0, (n2[k] - n1[k]) - (d2[k] - d1[k]))
            res[k] += layer
            res["recompute"] += layer
    # The backward's working gradient of the largest residual, counted with its kind.
    res[n2["largest_kind"]] += n2["largest"]
    res["total"] = res["weights"] + res["attention"] + res["other"]
    return res


@functools.lru_cache(maxsize=None)
def trace_stage(kind: str, stage_key: str, config: ModelConfig, micro: int, accum: int,
                T: int, teacher_dims: tuple) -> dict:
    """jax.eval_shape of one forward, the loss's per-token quantity and the whole train step
    at full depth, for one device's share of the batch. Returns the traced shapes."""
    from opd_jax.losses import token_logprobs
    from opd_jax.trainers.objectives import make_objective
    from opd_jax.trainers.policy import policy_step
    from opd_jax.trainers.sft import sft_step
    from opd_jax.trainers.state import TrainState, make_optimizer
    from pallas_kernels import fused_reverse_kl
    spec = json.loads(stage_key)
    graphdef, params, rest = nnx.split(abstract_model(config), nnx.Param, ...)
    tx = make_optimizer(ml_collections.ConfigDict(spec["optim"]), 100)
    state = TrainState(step=_sds((), jnp.int32), params=params, rest=rest,
                       opt_state=jax.eval_shape(tx.init, params))
    objective = spec.get("objective", {}).get("name")
    rows = micro * accum if kind == "sft" else micro
    batch, teachers = _batch(kind, objective, rows, T, teacher_dims, "bfloat16")
    if kind == "sft":
        step = functools.partial(sft_step, graphdef=graphdef, tx=tx, grad_accum=accum)
    else:
        obj = make_objective(objective, **spec["objective"]["options"])
        step = functools.partial(policy_step, graphdef=graphdef, tx=tx, objective=obj)

    def run(state, batch, teachers):
        model = nnx.merge(graphdef, state.params, state.rest)
        if objective == "deepseek_full_vocab":
            fwd = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"], return_hidden=True)
            B, T_, D = fwd.shape
            per_token = fused_reverse_kl(fwd.reshape(B * T_, D), model.unembedding(),
                                         batch["teacher_hidden"][0].reshape(B * T_, -1),
                                         teachers[0])
        else:
            fwd = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
            per_token = token_logprobs(fwd, batch["targets"])
        new_state, metrics = (step(state, batch) if kind == "sft"
                              else step(state, batch, teachers))
        return fwd, per_token, new_state, metrics

    fwd, per_token, new_state, metrics = jax.eval_shape(run, state, batch, teachers)
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
    if shapes(new_state) != shapes(state):
        raise ValueError(f"{kind} step: the new train state's shapes differ from the old one's")
    if metrics["loss"].shape != ():
        raise ValueError(f"{kind} step: loss has shape {metrics['loss'].shape}, expected ()")
    what = "hidden" if objective == "deepseek_full_vocab" else "logits"
    quantity = "full-vocab reverse KL" if objective == "deepseek_full_vocab" else "token log-probs"
    return {"forward": f"{what} {list(fwd.shape)}", "per_token": f"{quantity} "
            f"{list(per_token.shape)}", "loss": list(metrics["loss"].shape),
            "state_leaves": len(jax.tree.leaves(new_state))}


def plan(c: ml_collections.ConfigDict):
    """The recipe's stages for its first seed, checked (names, references)."""
    from opd_jax.recipes import recipe_module
    from opd_jax.recipes.pipeline import check_stages
    stages = recipe_module(c.recipe).build(c, int(tuple(c.seeds)[0]))
    check_stages(stages)
    return stages


def estimate(c: ml_collections.ConfigDict, *, trace: bool = True) -> list[dict]:
    """One row per stage of a scale-up config (see the module doc). ``trace=False`` skips
    the full-depth ``jax.eval_shape`` of the steps (the memory numbers do not need it)."""
    if "scale" not in c:
        raise ValueError(f"config of recipe {c.get('recipe')!r} has no `scale` section: "
                         f"expected a scale-up preset ({', '.join(sorted(MESHES))}, made by "
                         f"apply_scale)")
    stages = plan(c)
    models = stage_models(stages)
    rows = []
    for s in stages:
        model = models[s.name]
        row = {"stage": s.name, "kind": s.kind, "model": model, "hbm_gib": float(c.scale.hbm_gib)}
        if s.kind == "merge":
            n = len(s.teachers) + (1 if s.init_from else 0) + 1     # inputs, base, result
            total = n * model.num_params() * jnp.dtype(model.param_dtype).itemsize
            row |= {"geometry": None, "params": total, "grads": 0, "optimizer": 0,
                    "activations": {"total": 0, "attention": 0}, "teacher_cache": 0,
                    "teacher_cache_fixed": 0,
                    "scoring": 0, "note": f"{n} models on one device"}
            rows.append(_totals(row))
            continue
        cfg = s.config
        mesh_shape, rules = tuple(cfg.mesh.shape), _rules(cfg)
        mesh = abstract_mesh(mesh_shape)
        geo = geometry(s, mesh)
        key = _stage_key(s)
        p = params_bytes(model, mesh_shape, rules)
        opt = optimizer_bytes(model, json.dumps(cfg.optim.to_dict(), sort_keys=True),
                              mesh_shape, rules)
        teacher_models = [models[ref] for ref in dict.fromkeys(s.teachers.values())]
        objective = cfg.objective.name if s.kind != "sft" else None
        hidden = objective == "deepseek_full_vocab"
        teacher_dims = tuple((t.hidden_size, t.vocab_size) for t in teacher_models) if hidden \
            else tuple((0, 0) for _ in teacher_models)
        cache = cache_per_token = 0        # teacher cache: fixed part, part that grows with T
        if teacher_models:
            n_loaded = min(cfg.teachers.max_loaded or len(teacher_models), len(teacher_models))
            bf16 = sorted((params_bytes(t.replace(param_dtype="bfloat16"), mesh_shape, rules)
                           for t in teacher_models), reverse=True)
            cache = sum(bf16[:n_loaded])
            if hidden:
                cache += sum(E * V * 2 for E, V in teacher_dims)
                cache_per_token = sum(geo.rows * E * 2 for E, _ in teacher_dims)
            else:
                cache_per_token = geo.rows * 4          # teacher log-probs of the iteration
        if s.kind != "sft" and cfg.objective.options.get("kl_beta", 0.0) > 0:
            p *= 2                                      # + the frozen reference policy
        acts = activation_bytes(s.kind, key, model, geo.micro, geo.seq, teacher_dims,
                                mesh_shape, rules)
        row |= {"geometry": geo, "params": p,
                "grads": p * (2 if s.kind == "sft" and geo.accum > 1 else 1),
                "optimizer": opt, "activations": acts,
                "teacher_cache": cache + cache_per_token * geo.seq,
                "teacher_cache_fixed": cache,
                "scoring": 0 if s.kind == "sft" else geo.micro * geo.seq * model.vocab_size * 6,
                "n_teachers": len(teacher_models),
                "n_loaded": min(cfg.teachers.max_loaded or len(teacher_models),
                                len(teacher_models)) if teacher_models else 0}
        if trace:
            row["trace"] = trace_stage(s.kind, key, model, geo.micro, geo.accum, geo.seq,
                                       teacher_dims)
        rows.append(_totals(row))
    return rows


def _totals(row: dict) -> dict:
    base = row["params"] + row["optimizer"] + row["teacher_cache"]
    row["train_peak"] = base + row["grads"] + row["activations"]["total"]
    row["score_peak"] = base + row["scoring"] if row["scoring"] else 0
    row["peak"] = max(row["train_peak"], row["score_peak"])
    row["fits"] = row["peak"] <= row["hbm_gib"] * GIB
    row["max_seq"] = _max_seq(row)
    return row


def _max_seq(row: dict, multiple: int = 256) -> int | None:
    """The longest T (a multiple of `multiple`) at which the row's peak fits its HBM, with
    the same rows: attention residuals grow as T^2, the other activations, the scoring
    logits and the cached teacher outputs as T, the rest is fixed. None: no T (or merge)."""
    geo = row["geometry"]
    if geo is None:
        return None
    a, hbm = row["activations"], row["hbm_gib"] * GIB
    cache_fixed = row["teacher_cache_fixed"]
    cache_lin = row["teacher_cache"] - cache_fixed
    fixed = row["params"] + row["optimizer"] + cache_fixed
    c0, c1, c2 = fixed + row["grads"] + a["weights"], a["other"] + cache_lin, a["attention"]
    room = hbm - c0
    if room <= 0:
        return None
    x = (-c1 + math.sqrt(c1 * c1 + 4 * c2 * room)) / (2 * c2) if c2 else room / c1
    if row["scoring"]:
        x = min(x, (hbm - fixed) / (row["scoring"] + cache_lin))
    t = int(x * geo.seq) // multiple * multiple
    return t or None


def _model_name(config: ModelConfig) -> str:
    for name in (STUDENT, TEACHER):
        if ModelConfig.preset(name).architecture() == config.architecture():
            return name
    return f"{config.num_layers}L d{config.hidden_size}"


def _group(rows: list[dict]) -> list[tuple[list[str], dict]]:
    """Rows with equal numbers (same kind, model and shapes) merged, in stage order."""
    groups: dict[tuple, tuple[list[str], dict]] = {}
    for r in rows:
        a = r["activations"]
        sig = (r["kind"], _model_name(r["model"]), r["geometry"], r["params"], r["grads"],
               r["optimizer"], a["total"], r["teacher_cache"], r["scoring"])
        groups.setdefault(sig, ([], r))[0].append(r["stage"])
    return list(groups.values())


def _names(names: list[str]) -> str:
    if len(names) <= 2:
        return ", ".join(names)
    prefix = os.path.commonprefix(names)
    return f"{prefix}* ({len(names)})" if prefix else f"{names[0]}, ... ({len(names)})"


def table(rows: list[dict]) -> str:
    """Markdown table of per-device GiB, one row per distinct stage (see the module doc)."""
    g = lambda b: f"{b / GIB:.1f}"
    head = ("| stages | kind | model | rows/dev (micro) | T | params | grads | optimizer "
            "| activations (attn) | teacher cache | scoring | peak | HBM | fits | fits up to T |")
    lines = [head, "|" + "---|" * 15]
    for names, r in _group(rows):
        geo = r["geometry"]
        a = r["activations"]
        shape = "-" if geo is None else f"{geo.rows} ({geo.micro})"
        cache = g(r["teacher_cache"])
        if r.get("n_loaded"):
            cache += f" ({r['n_loaded']} of {r['n_teachers']})"
        lines.append(
            f"| {_names(names)} | {r['kind']} | {_model_name(r['model'])} | {shape} | "
            f"{'-' if geo is None else geo.seq} | {g(r['params'])} | {g(r['grads'])} | "
            f"{g(r['optimizer'])} | {g(a['total'])} ({g(a['attention'])}) | {cache} | "
            f"{g(r['scoring'])} | {g(r['peak'])} | {r['hbm_gib']:.0f} | "
            f"{'yes' if r['fits'] else 'no'} | {r['max_seq'] or '-'} |")
    return "\n".join(lines)


def report(c: ml_collections.ConfigDict, *, trace: bool = True) -> str:
    """The printed block for one config: header, table, traced shapes."""
    rows = estimate(c, trace=trace)
    mesh = MESHES[c.scale.preset]
    remat = "/".join(sorted({r["model"].remat for r in rows if r["kind"] != "merge"}))
    out = [f"{c.recipe} `{c.scale.preset}`: {mesh.name}, mesh {mesh.shape} (data, fsdp, "
           f"tensor), {len(rows)} stages, model.remat {remat!r}; per-device GiB:", "",
           table(rows)]
    if trace:
        out += ["", "Traced with jax.eval_shape (full depth; one device's rows of one optimizer "
                    "step: forward -> per-token loss term -> loss; the whole train step):"]
        for names, r in _group(rows):
            t = r.get("trace")
            if t:
                out.append(f"- {_names(names)}: {t['forward']} -> {t['per_token']} -> loss "
                           f"{tuple(t['loss'])}; step returns the same {t['state_leaves']} "
                           f"state arrays")
    return "\n".join(out)


def main(argv=None) -> None:
    from opd_jax.config import load_config
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="experiments/<recipe>/config.py:"
                        "scale_v5p64 or :scale_8xh100 (repeatable; default: all six)")
    parser.add_argument("--no_trace", action="store_true", help="skip the full-depth traces")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    specs = args.config or [os.path.join(root, "experiments", r, f"config.py:{p}")
                            for r in SECTIONS for p in MESHES]
    blocks = [report(load_config(spec), trace=not args.no_trace) for spec in specs]
    print("\n\n".join(blocks))


if __name__ == "__main__":
    main()
