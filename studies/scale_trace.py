"""Abstract shapes of the scale-up stages: sharded bytes, saved residuals, traced steps.

Nothing here allocates: models come from ``nnx.eval_shape``, optimizer states from
``jax.eval_shape``, per-device shards from ``NamedSharding.shard_shape`` on an
``AbstractMesh``, the residuals autodiff saves from the public
``jax.ad_checkpoint.print_saved_residuals`` and the train steps from ``jax.eval_shape``.
:mod:`studies.scale_estimate` turns these numbers into the per-device memory table.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AbstractMesh, AxisType

from opd_jax import sharding as sh
from opd_jax.losses import token_logprobs
from opd_jax.models import ModelConfig, Transformer
from opd_jax.trainers.objectives import needs_of
from opd_jax.trainers.objectives import make_objective
from opd_jax.trainers.policy import policy_step
from opd_jax.trainers.sft import sft_micro_loss, sft_step
from opd_jax.trainers.state import TrainState, make_optimizer
from pallas_kernels import fused_reverse_kl

_HERE = os.path.basename(__file__)


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


def _shards(tree, mesh: AbstractMesh, rules) -> list[tuple[tuple, jnp.dtype, tuple]]:
    """(shape, dtype, per-device shard shape) of each leaf of `tree` (abstract arrays / nnx
    Variables), placed by its logical names and the rules (unnamed leaves replicated)."""
    shardings = sh.state_shardings(tree, mesh, rules)
    is_var = lambda x: isinstance(x, nnx.Variable)
    leaves = jax.tree.leaves(tree, is_leaf=is_var)
    specs = jax.tree.leaves(shardings, is_leaf=is_var)
    if len(leaves) != len(specs):
        raise AssertionError(f"{len(leaves)} leaves but {len(specs)} shardings")
    out = []
    for leaf, spec in zip(leaves, specs):
        x, s = _value(leaf), _value(spec)
        shape = tuple(x.shape)
        out.append((shape, jnp.dtype(x.dtype), tuple(s.shard_shape(shape))))
    return out


def per_device_bytes(tree, mesh: AbstractMesh, rules=sh.DEFAULT_RULES) -> int:
    """Bytes of the largest per-device shard of `tree` (abstract arrays / nnx Variables),
    each leaf placed by its logical names and the rules (unnamed leaves replicated)."""
    return sum(math.prod(shard) * dtype.itemsize for _, dtype, shard in _shards(tree, mesh, rules))


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
    tx = make_optimizer(ml_collections.ConfigDict(json.loads(optim_key)), 100)
    _, params, _ = nnx.split(abstract_model(config), nnx.Param, ...)
    return per_device_bytes(jax.eval_shape(tx.init, params), abstract_mesh(mesh_shape), rules)


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _batch(kind: str, objective: str | None, rows: int, T: int, teacher_dims: tuple,
           teacher_dtype: str, top_k: int = 0) -> tuple[dict, tuple]:
    """An abstract batch (and teacher unembeddings) with every key the stage's step reads
    (`top_k`: the top-k signal's K)."""
    i32, f32 = (lambda: _sds((rows, T), jnp.int32)), (lambda: _sds((rows, T), jnp.float32))
    batch = dict(inputs=i32(), targets=i32(), mask=i32(), segment_ids=i32())
    if kind == "sft":
        return batch | dict(positions=i32()), ()
    batch |= dict(sampler_logp=f32(), old_logp=f32(), adv=_sds((rows,), jnp.float32))
    S = len(teacher_dims)
    teacher = needs_of(objective).teacher
    if teacher == "hidden":
        batch |= dict(teacher_hidden=tuple(_sds((rows, T, E), teacher_dtype)
                                           for E, _ in teacher_dims),
                      teacher_weights=_sds((rows, S), jnp.float32))
        return batch, tuple(_sds((E, V), teacher_dtype) for E, V in teacher_dims)
    if teacher == "logp":
        batch |= dict(teacher_logp=f32(), teacher_onehot=_sds((rows, S), jnp.float32))
    if teacher == "topk":
        batch |= dict(teacher_topk_ids=_sds((rows, T, top_k), jnp.int32),
                      teacher_topk_logp=_sds((rows, T, top_k), jnp.float32),
                      teacher_onehot=_sds((rows, S), jnp.float32))
    return batch, ()


def _top_k(spec: dict) -> int:
    """The top-k signal's K of a stage (0 without one)."""
    return int(spec.get("objective", {}).get("options", {}).get("top_k", 0))


def _loss_fn(kind: str, stage_key: str):
    """(params, rest, batch, teachers) -> scalar loss of one micro-batch, as the trainer's."""
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
_AVAL = re.compile(r"^([a-z]+)(\d*)\[([\d,]*)\] (.*)$")
_DTYPES = {"bf": "bfloat", "f": "float", "i": "int", "u": "uint", "c": "complex"}


def saved_residuals(f, *args) -> list[tuple[jax.ShapeDtypeStruct | None, str]]:
    """The residuals autodiff saves for the backward of `f` at `args`, as (abstract array,
    where it comes from), read from the public ``jax.ad_checkpoint.print_saved_residuals``
    (one ``<dtype>[<shape>] <where>`` line each). Lines that are not a plain array (an
    extended dtype such as a PRNG key) come back as (None, where)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(f, *args)
    out = []
    for line in buf.getvalue().splitlines():
        m = _AVAL.match(line)
        name = m and (m.group(1) if m.group(1) == "bool" else
                      _DTYPES.get(m.group(1), "") + m.group(2))
        try:
            dtype = jnp.dtype(name) if m else None
        except TypeError:
            dtype = None
        if dtype is None:
            out.append((None, line.split(" ", 1)[-1]))
            continue
        shape = tuple(int(d) for d in m.group(3).split(",") if d)
        out.append((jax.ShapeDtypeStruct(shape, dtype), m.group(4)))
    return out


@functools.lru_cache(maxsize=None)
def _residuals(kind: str, stage_key: str, config: ModelConfig, micro: int, T: int,
               teacher_dims: tuple, mesh_shape: tuple, rules: tuple) -> tuple[dict, dict]:
    """Per-device saved residuals of one micro-batch's loss at depth 1 and 2, by kind
    (weights / attention / other), with the largest one and its kind."""
    mesh = abstract_mesh(mesh_shape)
    objective = json.loads(stage_key).get("objective", {}).get("name")
    loss = _loss_fn(kind, stage_key)
    out = []
    for depth in (1, 2):
        cfg = config.replace(num_layers=depth)
        graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
        # Per-device fraction of each param shape (bf16 copies of weights are residuals too).
        frac = {}
        for shape, _, shard in _shards(params, mesh, rules):
            f = math.prod(shard) / math.prod(shape)
            frac.setdefault(shape, f)
            frac.setdefault(shape[::-1], f)         # transposed (the tied unembedding)
        batch, teachers = _batch(kind, objective, micro, T, teacher_dims, "bfloat16",
                                 _top_k(json.loads(stage_key)))

        def f(params, rest, batch, teachers):
            sg = jax.lax.stop_gradient
            return loss(graphdef, params, sg(rest), jax.tree.map(sg, batch),
                        jax.tree.map(sg, teachers))

        acc = {"weights": 0.0, "attention": 0.0, "other": 0.0, "largest": 0.0,
               "largest_kind": "other"}
        for aval, where in saved_residuals(f, params, rest, batch, teachers):
            if (where.startswith("from the argument") or aval is None
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
    spec = json.loads(stage_key)
    graphdef, params, rest = nnx.split(abstract_model(config), nnx.Param, ...)
    tx = make_optimizer(ml_collections.ConfigDict(spec["optim"]), 100)
    state = TrainState(step=_sds((), jnp.int32), params=params, rest=rest,
                       opt_state=jax.eval_shape(tx.init, params))
    objective = spec.get("objective", {}).get("name")
    rows = micro * accum if kind == "sft" else micro
    batch, teachers = _batch(kind, objective, rows, T, teacher_dims, "bfloat16", _top_k(spec))
    if kind == "sft":
        step = functools.partial(sft_step, graphdef=graphdef, tx=tx, grad_accum=accum)
    else:
        obj = make_objective(objective, **spec["objective"]["options"])
        step = functools.partial(policy_step, graphdef=graphdef, tx=tx, objective=obj)

    hidden = kind != "sft" and needs_of(objective).teacher == "hidden"

    def run(state, batch, teachers):
        model = nnx.merge(graphdef, state.params, state.rest)
        if hidden:
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
    what = "hidden" if hidden else "logits"
    quantity = "full-vocab reverse KL" if hidden else "token log-probs"
    return {"forward": f"{what} {list(fwd.shape)}", "per_token": f"{quantity} "
            f"{list(per_token.shape)}", "loss": list(metrics["loss"].shape),
            "state_leaves": len(jax.tree.leaves(new_state))}
