"""Shape checks and a per-device memory estimate of the scale-up presets.

The presets (``scale_v5p64``, ``scale_8xh100``) are made by
:func:`studies.scale_up.apply_scale`; the abstract shapes behind the numbers (sharded
bytes, saved residuals, traced steps) come from :mod:`studies.scale_trace`.

    python -m studies.scale_estimate --config experiments/kimi_k3/config.py:scale_8xh100
    python -m studies.scale_estimate        # every recipe x both meshes

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
import json
import math
import os

import jax.numpy as jnp
import ml_collections
from jax.sharding import AbstractMesh

from opd_jax import sharding as sh
from opd_jax.config import load_config
from opd_jax.models import ModelConfig
from opd_jax.recipes import recipe_module
from opd_jax.recipes.pipeline import check_stages
from opd_jax.trainers.builders import model_config_from, policy_rows
from opd_jax.trainers.objectives import needs_of
from studies.scale_trace import (_rules, _stage_key, abstract_mesh, activation_bytes,
                                 optimizer_bytes, params_bytes, trace_stage)
from studies.scale_up import MESHES, SECTIONS, STUDENT, TEACHER

GIB = 1024 ** 3


def stage_models(stages) -> dict[str, ModelConfig]:
    """Each stage's model: its own section, or (init_from) the model of the stage it starts
    from, which must have the same architecture as the section (the runtime reads the
    checkpoint's; a differing section would be silently ignored). Teachers and merged
    models must share the student's vocabulary / the base's architecture."""
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
    try:
        rows = policy_rows(cfg, devices)
    except ValueError as e:
        raise ValueError(f"stage {stage.name!r}: {e}") from None
    mb, T = cfg.rl.minibatches, cfg.rollout.seq_len
    if T <= 0:
        raise ValueError(f"stage {stage.name!r}: rollout.seq_len={T} (bucketed per batch); "
                         f"expected a fixed positive length to estimate memory at")
    return Geometry(rows // devices, rows // devices // mb, T, mb)



def plan(c: ml_collections.ConfigDict):
    """The recipe's stages for its first seed, checked (names, references)."""
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
        needs = needs_of(objective) if objective else None
        hidden = needs is not None and needs.teacher == "hidden"
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
            elif needs.teacher == "topk":             # K ids (int32) + K log-probs (fp32)
                cache_per_token = geo.rows * 8 * int(cfg.objective.options.top_k)
            else:
                cache_per_token = geo.rows * 4          # teacher log-probs of the iteration
        if needs is not None and needs.reference and \
                cfg.objective.options.get(needs.reference, 0.0) > 0:
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="experiments/<recipe>/config.py:"
                        "scale_v5p64 or :scale_8xh100 (repeatable; default: all six)")
    parser.add_argument("--no_trace", action="store_true", help="skip the full-depth traces")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    specs = args.config or [os.path.join(root, "experiments", r, f"config.py:{p}")
                            for r in SECTIONS for p in MESHES]
    blocks = [report(load_config(spec), trace=not args.no_trace) for spec in specs]
    print("\n\n".join(blocks))


if __name__ == "__main__":
    main()
