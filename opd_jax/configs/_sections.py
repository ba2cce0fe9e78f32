"""Config sections shared by the config files here (imported as a sibling); not a config."""
import dataclasses

import ml_collections

from opd_jax.envs.rewards import DEFAULT_RUBRIC
from opd_jax.losses import Correction
from opd_jax.sharding import DEFAULT_RULES


def model_config(**overrides) -> ml_collections.ConfigDict:
    m = ml_collections.ConfigDict(dict(
        init_from="",            # HF folder to load (config.json + safetensors); "" = random init
        arch="qwen3",
        vocab_size=128,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        max_position_embeddings=512,
        dtype="float32",
        param_dtype="float32",
        remat="none",            # "none" | "layer" | "dots": gradient checkpointing per layer
    ))
    m.update(overrides)
    return m


def correction_config(**overrides) -> dict:
    """The mismatch correction of the sampled-token objectives (`opd_jax.losses.Correction`,
    its defaults: IcePop with bounds (0.5, 5.0), rejected tokens kept in the normalizer):
    --config.objective.options.correction.kind=tis (or None) switches it."""
    return dict(dataclasses.asdict(Correction()), **overrides)


def optim_config(**overrides) -> ml_collections.ConfigDict:
    o = ml_collections.ConfigDict(dict(
        name="adamw", lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01,
        warmup_steps=20, schedule="cosine",   # "cosine" | "constant"
        min_lr_ratio=0.1, grad_clip=1.0, grad_accum=1,
    ))
    o.update(overrides)
    return o


def eval_config(**overrides) -> ml_collections.ConfigDict:
    """Held-out evaluation: n tasks per cell, greedy by default (see opd_jax.trainers.evaluate)."""
    e = ml_collections.ConfigDict(dict(
        every=10,                # policy trainers: evaluate every N iterations (0 = only at the end)
        n=32, seed=0, batch_size=64,
        sampling=ml_collections.ConfigDict(dict(
            max_new_tokens=24, temperature=0.0, top_k=0, top_p=1.0, max_turns=3,
            use_think_budget=True)),
    ))
    e.update(overrides)
    return e


def policy_base(init_from: str = "") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = model_config(init_from=init_from)
    c.tokenizer = "synthetic"
    c.tasks = ml_collections.ConfigDict(dict(
        families={"general": "arithmetic"}, efforts=("high",), difficulty=1, size=10_000, seed=0,
        cells=()))   # non-empty: train only these "domain/effort" cells of the grid
    c.rollout = ml_collections.ConfigDict(dict(
        prompts_per_step=8, group_size=4, seq_len=0,    # seq_len 0: bucket per batch
        # decode steps between commits of the rollout's token log (workdir/rollout_wal/):
        # a killed run resumes its rollout from it; 0 = no log (always off multi-process)
        wal_every=32,
        sampling=ml_collections.ConfigDict(dict(
            max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, max_turns=3,
            use_think_budget=True)),
    ))
    c.eval = eval_config()
    c.rl = ml_collections.ConfigDict(dict(
        adv_scale="std", dynamic_sampling=False, ppo_epochs=1, minibatches=1,
        # DAPO soft overlong punishment: the last `overlong_buffer` tokens before
        # max_new_tokens x max_turns ramp the reward down to -1 (0 = off)
        overlong_buffer=0))
    # A generative reward model mixed into the task reward (opd_jax/trainers/judge.py):
    # training reward = task + weight * judge score in [0, 1]; path "" = no judge.
    c.rewards = ml_collections.ConfigDict(dict(judge=ml_collections.ConfigDict(dict(
        path="",                 # HF folder, opd_jax workdir or builtin:NAME
        rubric=DEFAULT_RUBRIC,   # what the judge scores, 0-10
        weight=0.0, max_new_tokens=16, include_reference=False, batch_size=64))))
    c.optim = optim_config(lr=1e-4, warmup_steps=0, schedule="constant", weight_decay=0.0)
    c.train = ml_collections.ConfigDict(dict(steps=30, log_every=1, ckpt_every=10,
                                             keep_checkpoints=2,
                                             max_bad_steps=0))  # >0: skip that many NaN steps
    c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1, 1), rules=DEFAULT_RULES))
    return c
