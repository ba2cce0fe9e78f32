"""The three recipes at real sizes: the scale-up presets.

Presets ``scale_v5p64`` and ``scale_8xh100`` of ``experiments/{kimi_k3,glm,deepseek_v4}/
config.py`` are the same recipes at real size, made by :func:`apply_scale`: a Qwen3-1.7B
student line (SFT and OPD stages; bf16 compute, fp32 params), Qwen3-8B teachers for kimi_k3
and deepseek_v4 (their own 8B SFT stage "teacher_sft", then GRPO; GLM's teachers are its
own earlier 1.7B stages), V = 151,936, realistic batches, and the mesh of a TPU v5p-64
slice ((4, 8, 1) data x fsdp x tensor, 95 GiB HBM per chip) or of one 8xH100 node
((1, 8, 1), 80 GiB). Every trained stage's model has ``remat="layer"`` (ModelConfig: each
decoder layer's forward recomputed in the backward; without it no training stage fits at
T = 4096). They are compile-checked, not run: paths such as ``/path/to/Qwen3-1.7B``
are placeholders for a local Hugging Face folder (config.json, tokenizer and safetensors)
that the real run must point to. The shape checks and the per-device memory estimate are
in :mod:`studies.scale_estimate` (its command line); this module only imports
``ml_collections`` and the model presets, so every experiment config can import it.

    python -m studies.scale_estimate --config experiments/kimi_k3/config.py:scale_8xh100
    python -m studies.scale_estimate        # every recipe x both meshes
"""
from __future__ import annotations

import dataclasses

import ml_collections

from opd_jax.models import ModelConfig


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
}
# deepseek_v4's config is kimi_k3's with another student (experiments/deepseek_v4/config.py):
# it is scaled as kimi_k3, then bounds its students' teacher caches at its own MAX_LOADED.
# Global sizes per mesh: SFT sequences per step, GRPO prompts per iteration (x GROUP samples),
# OPD prompts per iteration (one sample each). Micro-batches are MICRO_ROWS rows per device.
SIZES = {"tpu-v5p-64": dict(sft_batch=128, rl_prompts=64, opd_prompts=256),
         "8xH100": dict(sft_batch=32, rl_prompts=16, opd_prompts=64)}
SEQ_LEN = 4096          # SFT packed length; RL/OPD rollout row length (prompt + all turns)
MAX_NEW_TOKENS = 3072   # per sampled turn
GROUP = 8               # GRPO samples per prompt
MICRO_ROWS = 1          # rows per device per micro-batch
REMAT = "layer"         # model.remat of every trained stage: each layer recomputed in the backward
MAX_LOADED = {"kimi_k3": 4, "glm": 2}     # < the bank: 9, 3 teachers


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
