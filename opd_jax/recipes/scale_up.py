"""The three recipes at real sizes, shape-checked and memory-estimated without running.

A Qwen3-1.7B student (V = 151,936) with Qwen3-8B teachers (GLM: earlier 1.7B stages of the
student's own line) on a TPU v5p-64 slice (32 devices, 95 GiB HBM each) and on one 8xH100
node (80 GiB each). For each (recipe, mesh): the student and a teacher are built with
`nnx.eval_shape` (no weights), their parameters are placed by the same logical-axis rules the
trainers use, one student forward and one fused full-vocab loss are traced with
`jax.eval_shape` at the per-device batch, and a per-device memory estimate is printed:

* params (fp32 master copy), gradients (fp32) and Adam moments (2 x fp32), sharded;
* activations kept for the backward pass: per layer ~(14 D + 3 F) values per token in bf16,
  for one micro-batch of `MICRO_ROWS` rows (gradient accumulation covers the rest of the
  device's rows; no rematerialisation — remat would divide this by ~the layer count);
* the teacher cache: `max_loaded` bf16 teachers sharded like the student, plus, for the
  full-vocab recipe, the cached teacher hidden states of one batch;
* the [tokens, V] fp32 logits the fused kernels avoid (for comparison, not counted).

    python -m opd_jax.recipes.scale_up          # prints the table
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from opd_jax import sharding as sh
from opd_jax.models import ModelConfig, Transformer

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    name: str
    shape: tuple[int, int, int]          # (data, fsdp, tensor)
    hbm_gib: float


@dataclasses.dataclass(frozen=True)
class RecipeSpec:
    name: str
    teacher: str                          # model preset of each teacher
    n_teachers: int
    max_loaded: int                       # teacher cache bound
    hidden_cache: bool                    # full-vocab: cache teacher hidden states


MESHES = (MeshSpec("tpu-v5p-64", (4, 8, 1), 95.0), MeshSpec("8xH100", (1, 8, 1), 80.0))
RECIPES = (RecipeSpec("kimi_k3", "qwen3-8b", 9, 2, False),
           RecipeSpec("glm", "qwen3-1.7b", 3, 3, False),
           RecipeSpec("deepseek_v4", "qwen3-8b", 4, 2, True))
STUDENT = "qwen3-1.7b"
GLOBAL_BATCH, SEQ_LEN = 256, 4096       # rows x tokens per optimizer step
MICRO_ROWS = 2                          # rows per device per micro-batch (grad accumulation)


def abstract_mesh(shape) -> AbstractMesh:
    return AbstractMesh(tuple(shape), sh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def sharded_bytes(config: ModelConfig, mesh: AbstractMesh, dtype) -> tuple[int, int]:
    """(total bytes, largest per-device bytes) of a model's params placed by the rules."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    itemsize = jnp.dtype(dtype).itemsize
    total = per_device = 0
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = (var.get_value() if hasattr(var, "get_value") else var.value).shape
        spec = sh._divisible_spec(sh.logical_to_spec(sh._logical_names(var), mesh=mesh),
                                  shape, mesh)
        parts = [1] * len(shape)
        for i, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
            for ax in sh._axes(entry):
                parts[i] *= mesh.shape[ax]
        total += math.prod(shape) * itemsize
        per_device += math.prod(-(-d // p) for d, p in zip(shape, parts)) * itemsize
    return total, per_device


def trace_student(config: ModelConfig, rows: int, seq: int) -> dict:
    """jax.eval_shape of the forward (hidden states) and the fused full-vocab loss."""
    from pallas_kernels import fused_reverse_kl
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)

    def fwd(state, tokens):
        m = nnx.merge(graphdef, state)
        h = m(tokens, return_hidden=True)
        n = rows * seq
        kl = fused_reverse_kl(h.reshape(n, -1), m.unembedding(), h.reshape(n, -1),
                              m.unembedding(), implementation="xla")
        return h, kl

    h, kl = jax.eval_shape(fwd, state, tokens)
    return {"hidden": h.shape, "kl": kl.shape}


def estimate(recipe: RecipeSpec, mesh_spec: MeshSpec) -> dict:
    mesh = abstract_mesh(mesh_spec.shape)
    student = ModelConfig.preset(STUDENT, dtype="bfloat16")
    teacher = ModelConfig.preset(recipe.teacher, dtype="bfloat16", param_dtype="bfloat16")
    if teacher.vocab_size != student.vocab_size:
        raise ValueError(f"teacher vocab {teacher.vocab_size} != student {student.vocab_size}")
    n_batch = mesh_spec.shape[0] * mesh_spec.shape[1]
    rows = max(GLOBAL_BATCH // n_batch, 1)
    micro = min(rows, MICRO_ROWS)
    tokens = micro * SEQ_LEN
    s_total, s_dev = sharded_bytes(student, mesh, jnp.float32)
    t_total, t_dev = sharded_bytes(teacher, mesh, jnp.bfloat16)
    D, F, L = student.hidden_size, student.intermediate_size, student.num_layers
    acts = tokens * L * (14 * D + 3 * F) * 2
    hidden_cache = tokens * teacher.hidden_size * 2 * recipe.max_loaded if recipe.hidden_cache else 0
    per_device = {
        "params": s_dev, "grads": s_dev, "adam": 2 * s_dev, "activations": acts,
        "teacher_cache": recipe.max_loaded * t_dev + hidden_cache,
    }
    return {"recipe": recipe.name, "mesh": mesh_spec.name, "devices": math.prod(mesh_spec.shape),
            "rows_per_device": rows, "grad_accum": rows // micro, "student_params_b": s_total / 4 / 1e9,
            "teacher_params_b": t_total / 2 / 1e9, "per_device_gib":
            {k: v / GIB for k, v in per_device.items()},
            "total_gib": sum(per_device.values()) / GIB, "hbm_gib": mesh_spec.hbm_gib,
            "logits_avoided_gib": tokens * student.vocab_size * 4 / GIB}


def table(rows) -> str:
    head = ("| recipe | mesh | rows/dev (accum) | params | grads | Adam | activations | teacher cache "
            "| total | HBM | fits | [tokens,V] fp32 logits avoided (per micro-batch) |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        g = r["per_device_gib"]
        lines.append(
            f"| {r['recipe']} | {r['mesh']} | {r['rows_per_device']} ({r['grad_accum']}) | "
            f"{g['params']:.2f} | "
            f"{g['grads']:.2f} | {g['adam']:.2f} | {g['activations']:.1f} | "
            f"{g['teacher_cache']:.2f} | {r['total_gib']:.1f} | {r['hbm_gib']:.0f} | "
            f"{'yes' if r['total_gib'] <= r['hbm_gib'] else 'no: remat'} | "
            f"{r['logits_avoided_gib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    rows = [estimate(r, m) for r in RECIPES for m in MESHES]
    print(f"student {STUDENT} ({rows[0]['student_params_b']:.2f}B params), batch "
          f"{GLOBAL_BATCH} x {SEQ_LEN} tokens; per-device GiB (estimates, see module doc):")
    print(table(rows))
    shapes = trace_student(ModelConfig.preset(STUDENT, dtype="bfloat16"), MICRO_ROWS, SEQ_LEN)
    print(f"student forward + fused full-vocab KL traced with jax.eval_shape at "
          f"{MICRO_ROWS} x {SEQ_LEN}: hidden {shapes['hidden']}, per-token KL {shapes['kl']}")


if __name__ == "__main__":
    main()
