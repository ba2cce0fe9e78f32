"""Supervised fine-tuning (SFT).

Run (tiny model, built-in synthetic task, CPU, about a minute):

    opd-jax sft --config configs/sft.py:tiny --workdir runs/sft_tiny

prints a progress bar and the masked token loss falling from ~4 to below 0.5, then where the
final checkpoint went. Re-running the same command resumes from the latest checkpoint.

Presets: ``tiny`` (default, CPU), ``jsonl`` (your data: set --config.data.path and
--config.tokenizer), ``qwen3_1p7b`` (an HF checkpoint folder; set --config.model.init_from).
Any key can be overridden, e.g. ``--config.optim.lr=1e-3 --config.train.steps=50``.
"""
import ml_collections

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
    ))
    m.update(overrides)
    return m


def optim_config(**overrides) -> ml_collections.ConfigDict:
    o = ml_collections.ConfigDict(dict(
        name="adamw", lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01,
        warmup_steps=20, schedule="cosine",   # "cosine" | "constant"
        min_lr_ratio=0.1, grad_clip=1.0, grad_accum=1,
    ))
    o.update(overrides)
    return o


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = model_config()
    c.tokenizer = "synthetic"            # "synthetic" or a local tokenizer folder
    c.data = ml_collections.ConfigDict(dict(
        source="synthetic",              # "synthetic" | "jsonl"
        path="",                          # JSONL file for source="jsonl"
        task="addition",                  # built-in synthetic task
        num_examples=2000,
        max_digits=2,
        seq_len=32,
        batch_size=32,
        packing=False,
        seed=0,
    ))
    c.optim = optim_config()
    c.train = ml_collections.ConfigDict(dict(
        steps=200, log_every=10, ckpt_every=50, keep_checkpoints=2,
    ))
    c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1, 1), rules=DEFAULT_RULES))

    if arg == "tiny":
        pass
    elif arg == "jsonl":
        c.data.source = "jsonl"
        c.data.seq_len = 512
        c.data.batch_size = 8
    elif arg == "qwen3_1p7b":
        c.model.init_from = "/path/to/Qwen3-1.7B"
        c.tokenizer = "/path/to/Qwen3-1.7B"
        c.model.dtype = "bfloat16"
        c.data.source = "jsonl"
        c.data.seq_len = 4096
        c.data.batch_size = 64
        c.data.packing = True
        c.optim.lr = 1e-5
        c.optim.warmup_steps = 100
        c.train.steps = 2000
        c.train.ckpt_every = 200
        c.mesh.shape = (1, -1, 1)
    else:
        raise KeyError(f"presets are tiny, jsonl, qwen3_1p7b; got {arg!r}")
    return c
