"""Supervised fine-tuning (SFT).

Run (a 0.4M-parameter model, built-in 2-digit addition task, CPU, 1-2 minutes after the
first compile):

    opd-jax sft --config configs/sft.py:tiny --workdir runs/sft_tiny

prints a progress bar with the masked token loss falling from ~4.8 to ~1.0 in 200 steps,
then where the final checkpoint went. Re-running the same command resumes from the latest checkpoint.

Presets: ``tiny`` (default, CPU), ``tasks`` (cold start on the built-in tasks' demos,
for RL and OPD), ``base`` (the built-in base model's pretraining on the corpus of every
family's train split; run through ``python -m studies.base_model``), ``jsonl`` (your data: set --config.data.path and
--config.tokenizer), ``qwen3_1p7b`` (an HF checkpoint folder; set --config.model.init_from;
4096-token rows with ``model.remat="layer"``, gradient checkpointing of each decoder layer).
Any key can be overridden, e.g. ``--config.optim.lr=1e-3 --config.train.steps=50``.
"""
import ml_collections

from opd_jax.trainers.config_schema import section


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = section("model")
    c.tokenizer = "synthetic"            # "synthetic" or a local tokenizer folder
    # source: "synthetic" (data.task) | "tasks" (data.tasks: task demos, the cold start) |
    # "corpus" (data.corpus: the base model's corpus) | "jsonl" (data.path)
    c.data = section("data")
    c.optim = section("optim")
    c.train = section("train")
    c.mesh = section("mesh")

    if arg == "tiny":
        pass
    elif arg == "tasks":                 # cold start for RL: demos of the built-in tasks
        c.data.source = "tasks"
        c.data.seq_len = 64
        c.train.steps = 300
        c.train.ckpt_every = 100
    elif arg == "base":                  # the built-in base model (studies.base_model)
        c.data.source = "corpus"
        c.data.seq_len = 320
        c.data.batch_size = 24
        c.data.packing = True
        c.model.update(num_layers=4, hidden_size=192, intermediate_size=768, num_heads=6,
                       num_kv_heads=2, head_dim=32, max_position_embeddings=512)
        c.optim.update(lr=3e-3, warmup_steps=100, min_lr_ratio=0.05)
        c.train.update(steps=1600, log_every=25, ckpt_every=200, keep_checkpoints=2)
    elif arg == "jsonl":
        c.data.source = "jsonl"
        c.data.seq_len = 512
        c.data.batch_size = 8
    elif arg == "qwen3_1p7b":
        c.model.init_from = "/path/to/Qwen3-1.7B"
        c.tokenizer = "/path/to/Qwen3-1.7B"
        c.model.dtype = "bfloat16"
        c.model.remat = "layer"          # 4096-token rows: recompute each layer in the backward
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
        raise KeyError(f"presets are tiny, tasks, base, jsonl, qwen3_1p7b; got {arg!r}")
    return c
