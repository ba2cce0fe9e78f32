"""Evaluate any checkpoint (an HF folder or an opd_jax workdir) on every (domain, effort) cell.

Run:

    opd-jax eval --checkpoint runs/grpo_general_high --config configs/eval.py:grid \
        --out runs/grpo_general_high/eval

prints a table (per cell: mean reward, pass rate, mean response length) and writes
eval.json and eval.csv to --out. Tasks are held out (a seed the trainers never train on)
and decoding is greedy, so the table is a function of the weights.

Presets: ``grid`` (3 domains x 3 efforts: arithmetic, tool_lookup, code_expr),
``general`` (arithmetic only, the three efforts).
"""
import ml_collections

from opd_jax.trainers.config_schema import section


def get_config(arg: str = "grid") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.tokenizer = "synthetic"
    c.tasks = section("eval_tasks", efforts=("low", "high", "max"), families={
        "general": "arithmetic", "agent": "tool_lookup", "coding": "code_expr"})
    c.eval = section("eval", every=0)
    if arg == "grid":
        pass
    elif arg == "general":
        c.tasks.families = {"general": "arithmetic"}
    else:
        raise KeyError(f"presets are grid, general; got {arg!r}")
    return c
