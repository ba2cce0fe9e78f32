"""Build the testbed's pretrained base model and its model card (run once, result committed).

    python -m studies.base_model --workdir runs/base          # train, export, card
    python -m studies.base_model --workdir runs/base --stage card   # card only

1. ``train``: ``opd-jax sft --config configs/sft.py:base`` (the project's own SFT trainer on
   `opd_jax.data.corpus`: demos from the *train* split of every family, every difficulty,
   every effort), resumable like any run.
2. ``export``: the final checkpoint as an HF folder (config.json + model.safetensors) in
   ``opd_jax/assets/base`` (``init_from="builtin:base"``).
3. ``card``: held-out reward (eval split, greedy) per testbed family x difficulty x effort
   over three evaluation seeds (disjoint problem draws), written to ``card.json`` and the
   model card ``README.md`` next to the weights, with parameters, corpus, steps, wall time
   and this command.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

from opd_jax.config import PACKAGED_CONFIGS, load_config
from opd_jax.data.corpus import corpus_families, pretraining_corpus
from opd_jax.envs import KNOWN_EFFORTS
from opd_jax.episodes import SamplingConfig
from opd_jax.models import ModelRef, save_pretrained, synthetic_tokenizer, tokenizer_meta
from opd_jax.models.builtin import builtin_path
from opd_jax.models.hf import read_config
from opd_jax.recipes import EFFORTS, TESTBED
from opd_jax.recipes.report import code_commit
from opd_jax.trainers.evaluate import evaluate_model

CONFIG = os.path.join(PACKAGED_CONFIGS, "sft.py") + ":base"
CARD_SEEDS = (0, 1, 2)
# Enough new tokens per turn for the max budget (192) and an answer; turns for 8 lookups.
CARD_SAMPLING = dict(max_new_tokens=224, temperature=0.0, max_turns=10)


def train(workdir: str, overrides=()) -> float:
    t0 = time.time()
    cmd = [sys.executable, "-m", "opd_jax", "sft", "--config", CONFIG, "--workdir", workdir,
           *overrides]
    subprocess.run(cmd, check=True)
    return time.time() - t0


def export(workdir: str, out: str) -> dict:
    model = ModelRef(workdir).load()
    save_pretrained(model, out, tokenizer=tokenizer_meta("synthetic", synthetic_tokenizer()))
    return {"n_params": sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))}


def evaluate_card(path: str, *, n: int, seeds=CARD_SEEDS, difficulties=(1, 2, 3, 4, 5),
                  families=None) -> list[dict]:
    """Rows (family, difficulty, effort, seed, reward, pass_rate, length) on the eval split."""
    model, tok = ModelRef(path).load(), synthetic_tokenizer()
    rows = []
    for seed in seeds:
        for domain, fam in (families or TESTBED).items():
            for d in difficulties:
                for r in evaluate_model(model, tok, {domain: fam}, EFFORTS, n=n, seed=seed,
                                        difficulty=d, sampling=SamplingConfig(**CARD_SAMPLING)):
                    rows.append({**r, "seed": seed})
                print(f"card: seed {seed} {fam} d{d}: " + ", ".join(
                    f"{r['effort']} {r['reward']:.2f}" for r in rows[-len(EFFORTS):]),
                    flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and std over seeds per (family, difficulty, effort)."""
    keys = list(dict.fromkeys((r["family"], r["difficulty"], r["effort"]) for r in rows))
    out = []
    for fam, d, e in keys:
        rs = [r for r in rows if (r["family"], r["difficulty"], r["effort"]) == (fam, d, e)]
        rew = np.array([r["reward"] for r in rs])
        out.append({"family": fam, "difficulty": d, "effort": e, "seeds": len(rs),
                    "n": rs[0]["n"], "reward_mean": float(rew.mean()),
                    "reward_std": float(rew.std(ddof=1)) if len(rs) > 1 else 0.0,
                    "pass_rate": float(np.mean([r["pass_rate"] for r in rs])),
                    "length": float(np.mean([r["length"] for r in rs]))})
    return out


def card_table(summary: list[dict]) -> str:
    """Pass rate (verifier correctness) and reward (with the length penalty) per family,
    difficulty and effort, means over the evaluation seeds (reward ± its std over seeds)."""
    lines = ["| family | difficulty | " + " | ".join(f"{e} pass" for e in EFFORTS) + " | " +
             " | ".join(f"{e} reward" for e in EFFORTS) + " | max length |",
             "|---|---:|" + "---:|" * (2 * len(EFFORTS) + 1)]
    by = {(s["family"], s["difficulty"], s["effort"]): s for s in summary}
    for fam, d in dict.fromkeys((s["family"], s["difficulty"]) for s in summary):
        cells = [by[(fam, d, e)] for e in EFFORTS]
        lines.append(f"| {fam} | {d} | " + " | ".join(f"{c['pass_rate']:.3f}" for c in cells)
                     + " | " + " | ".join(f"{c['reward_mean']:.3f} ± {c['reward_std']:.3f}"
                                          for c in cells)
                     + f" | {cells[-1]['length']:.0f} |")
    return "\n".join(lines)


def recreate_command(argv) -> str:
    """The command that re-creates this base (train, export, card): this invocation's
    arguments without its --stage."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--stage":
            skip = True
        elif not a.startswith("--stage="):
            args.append(a if " " not in a else f'"{a}"')
    return "python -m studies.base_model " + " ".join(args)


def dosed(card: dict) -> str:
    """The card's words for a dosed corpus (issue 31: headroom on the teacher cells)."""
    dose = card["corpus"].get("dose")
    if not dose:
        return ""
    cells = "; ".join(f"{fam} " + ", ".join(f"d{d}: {n}" for d, n in sorted(levels.items()))
                      for fam, levels in sorted(dose.items()))
    return (f" **Dosed cells** (demos per effort instead of the counts above, so the "
            f"recipes' teacher cells keep headroom): {cells}.")


def continued(card: dict) -> str:
    """The card's words for a base whose training continued another checkpoint."""
    init = card.get("init_from")
    return (f", continuing `{init}` (a first phase of pretraining, with its own run_config.json)"
            if init else "")


def write_card(out: str, card: dict) -> None:
    with open(os.path.join(out, "card.json"), "w", encoding="utf-8") as f:
        json.dump(card, f, indent=1)
    m = card["model"]
    text = f"""# builtin:base — the testbed's pretrained base model

A {m['num_layers']}-layer decoder ({m['arch']}: hidden {m['hidden_size']}, {m['num_heads']} query /
{m['num_kv_heads']} KV heads, MLP {m['intermediate_size']}), {card['n_params']:,} parameters, fp32,
the synthetic char-level tokenizer (vocab {m['vocab_size']}). Load it with
`init_from="builtin:base"` (any trainer's `model.init_from`, `ModelRef`, `opd-jax eval
--checkpoint builtin:base`).

**Corpus.** Demos from the *train* split of every built-in family with a generator
({', '.join(card['corpus']['families'])}) at every difficulty and under every effort
({', '.join(card['corpus']['efforts'])}): {card['corpus']['examples']:,} examples, the testbed
families (chain, tool_chain, code_trace) {card['corpus']['testbed_per_cell']} per cell, the others
{card['corpus']['per_cell']}. Each demo carries the most detailed scratchpad that fits its effort's
think budget (full steps, running totals, every k-th total, or a direct answer). No eval-split
problem can be in it (the split is a hash of the problem).{dosed(card)}

**Training.** {card['steps']} steps of the SFT trainer, batch {card['batch']} packed rows of
{card['seq_len']} tokens, AdamW lr {card['lr']} cosine; {card['train_wall_s'] / 60:.0f} minutes on
{card['machine']}{continued(card)}. Commit {card['commit']}. Re-create it with

    {card['command']}

**Held-out pass rate and reward** (eval split, greedy, think budget enforced; means, ± std over evaluation
seeds {', '.join(map(str, card['eval']['seeds']))}, {card['eval']['n']} problems per cell and seed):

{card_table(card['summary'])}
"""
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/base")
    p.add_argument("--out", default=builtin_path("base"))
    p.add_argument("--stage", choices=("all", "train", "export", "card"), default="all")
    p.add_argument("--eval-n", type=int, default=64)
    args, overrides = p.parse_known_args(argv)
    cfg = load_config(CONFIG, overrides)
    state_path = os.path.join(args.workdir, "base_model.json")
    state = json.load(open(state_path)) if os.path.exists(state_path) else {}
    if args.stage in ("all", "train"):
        state["train_wall_s"] = state.get("train_wall_s", 0.0) + train(args.workdir, overrides)
        json.dump(state, open(state_path, "w"))
    if args.stage in ("all", "export"):
        state.update(export(args.workdir, args.out))
        json.dump(state, open(state_path, "w"))
    if args.stage in ("all", "card"):
        t0 = time.time()
        dose = cfg.data.corpus.dose.to_dict()
        state["examples"] = len(pretraining_corpus(
            per_cell=cfg.data.corpus.per_cell, testbed_per_cell=cfg.data.corpus.testbed_per_cell,
            seed=cfg.data.seed, dose=dose))
        rows = evaluate_card(args.out, n=args.eval_n)
        card = {
            "n_params": state["n_params"], "model": read_config(args.out).to_dict(),
            "corpus": {"families": corpus_families(), "efforts": list(KNOWN_EFFORTS),
                       "per_cell": cfg.data.corpus.per_cell,
                       "testbed_per_cell": cfg.data.corpus.testbed_per_cell,
                       "dose": dose, "examples": state.get("examples")},
            "steps": cfg.train.steps, "batch": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
            "lr": cfg.optim.lr, "train_wall_s": state.get("train_wall_s", float("nan")),
            "machine": "2 CPU cores (shared with other jobs)", "commit": code_commit(),
            "command": recreate_command(argv if argv is not None else sys.argv[1:]),
            "init_from": cfg.model.init_from,
            "eval": {"seeds": list(CARD_SEEDS), "n": args.eval_n, "sampling": CARD_SAMPLING,
                     "wall_s": time.time() - t0},
            "rows": rows, "summary": summarize(rows)}
        write_card(args.out, card)
        print(card_table(card["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
