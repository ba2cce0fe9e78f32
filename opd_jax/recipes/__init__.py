"""The three recipes as multi-stage experiments: kimi_k3, glm, deepseek_v4.

    opd-jax experiment --config experiments/kimi_k3/config.py:reduced --workdir runs/kimi_k3

runs every stage of every seed (resumable), evaluates, and writes results.json,
results.md and PNG plots under the workdir. See `pipeline` (stages) and `report` (the
report, and what a recipe module provides).
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import ml_collections

from opd_jax.config import PACKAGED_CONFIGS, load_config
from opd_jax.models import build_tokenizer
from opd_jax.recipes import report as rp
from opd_jax.recipes.pipeline import check_finished, check_stages, run_stages
from opd_jax.trainers.config_schema import validate_experiment

RECIPES = ("kimi_k3", "glm", "deepseek_v4", "real_smollm2")

# The testbed (docs/testbed.md): the family each domain trains and is evaluated on, the
# efforts, and one table of both: the ones the base (`builtin:base`) was pretrained and
# carded on.
TESTBED = {"general": "chain", "agent": "tool_chain", "coding": "code_trace"}
EFFORTS = ("low", "high", "max")
# The evaluation difficulty of each domain: where the base's corpus is dosed (few demos, none
# above: the teacher cells' headroom, experiments/dose) and where the effort budgets sit inside
# two adjacent scratchpad forms' lengths (docs/testbed.md; tests/envs/test_splits.py).
EVAL_DIFFICULTY = {"general": 3, "agent": 3, "coding": 3}
# The testbed's sampling: enough new tokens per turn for the max budget (192) and an answer;
# turns for 8 lookups.
SAMPLING = dict(max_new_tokens=224, temperature=0.0, max_turns=10)


def recipe_module(name: str):
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r}: expected one of {RECIPES}")
    return importlib.import_module(f"opd_jax.recipes.{name}")


def run_experiment(c, workdir: str, *, progress: bool = True, command: str | None = None) -> dict:
    """Every seed's stages, then the report. Re-running resumes / only re-reports.

    command: how this was invoked, for the results' provenance (default: this process's
    argv)."""
    validate_experiment(c)      # its own values; each stage's below, before any write
    mod = recipe_module(c.recipe)
    seeds = tuple(int(s) for s in c.seeds)
    if not seeds:
        raise ValueError("experiment needs at least one seed (config.seeds)")
    for seed in seeds:   # every seed's plan, and its finished stages, before anything is written
        stages = mod.build(c, seed)
        check_stages(stages)
        check_finished(stages, os.path.join(workdir, f"seed{seed}"))
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(c.to_dict(), f, indent=2, default=str)
    rp.write_provenance(workdir, command or " ".join(
        ["opd-jax" if os.path.basename(sys.argv[0]) == "opd-jax" else sys.argv[0],
         *sys.argv[1:]]))
    for seed in seeds:
        print(f"== {c.recipe} seed {seed}", flush=True)
        run_stages(mod.build(c, seed), os.path.join(workdir, f"seed{seed}"), progress=progress)
    return rp.report(mod, c, workdir, seeds, build_tokenizer(c.tokenizer))


def trainer_config(path: str, *overrides: str):
    """A trainer config shipped in the package (opd_jax/configs/), unlocked for recipes.

    >>> trainer_config("grpo.py:tiny", "--config.train.steps=20")
    """
    return ml_collections.ConfigDict(
        load_config(os.path.join(PACKAGED_CONFIGS, path), list(overrides)).to_dict())


def policy_overrides(*, steps: int, lr: float, prompts: int, difficulty: int = 1,
                     max_new_tokens: int = 48, eval_every: int = 5, eval_n: int = 16,
                     warmup: int = 10) -> list[str]:
    """Overrides shared by the recipes' GRPO and OPD stages (one place to tune them)."""
    return [f"--config.train.steps={steps}", f"--config.optim.lr={lr}",
            f"--config.optim.warmup_steps={warmup}", f"--config.rollout.prompts_per_step={prompts}",
            f"--config.tasks.difficulty={difficulty}", f"--config.eval.every={eval_every}",
            f"--config.eval.n={eval_n}", f"--config.rollout.sampling.max_new_tokens={max_new_tokens}"]


BASE = "builtin:base"


def on_testbed(c, sft_sections, policy_sections) -> None:
    """Put a recipe config on the testbed (docs/testbed.md), in place: the start
    (``c.start``) is the shipped base, every stage that starts from no other stage starts
    from it, every stage trains on its domains' train split
    at their common evaluation difficulty with the testbed's token budget, and the report
    evaluates there (``c.eval.difficulty``). ``c.domains`` must map each
    domain to its testbed family.

    sft_sections / policy_sections: names of the config's SFT and GRPO/OPD sections.
    """
    bad = {d: f for d, f in dict(c.domains).items() if TESTBED.get(d) != f}
    if bad:
        raise ValueError(f"domains {bad}: expected the testbed's families {TESTBED}")
    levels = {EVAL_DIFFICULTY[d] for d in c.domains}
    if len(levels) != 1:
        raise ValueError(f"domains {sorted(c.domains)} have evaluation difficulties "
                         f"{EVAL_DIFFICULTY}: expected one difficulty for the recipe")
    difficulty = levels.pop()
    c.start = BASE
    for name in (*sft_sections, *policy_sections):   # a stage that starts from no stage
        c[name].model.init_from = BASE
    for name in sft_sections:
        c[name].data.tasks.difficulty = difficulty
        c[name].data.update(dict(seq_len=320, packing=True, batch_size=24))
    for name in policy_sections:
        s = c[name]
        s.tasks.difficulty = difficulty
        for sampling in (s.rollout.sampling, s.eval.sampling):
            sampling.update(dict(max_new_tokens=SAMPLING["max_new_tokens"],
                                 max_turns=SAMPLING["max_turns"]))
    c.eval.difficulty = difficulty
    c.eval.sampling.update(dict(max_new_tokens=SAMPLING["max_new_tokens"],
                                max_turns=SAMPLING["max_turns"]))


def shrink_for_smoke(c, rl, *students) -> None:
    """The `smoke` presets' sizes: a random 1-layer model (the one preset not started from
    the base: it tests plumbing, in the default suite, and the base's 4 layers and 320-token
    rows made the three recipes' smoke runs 8x slower), a few steps, short rollouts, tiny
    evaluations.

    rl: the GRPO stage config(s) section (group size 2); students: the OPD sections.
    Rollout batches stay divisible by the 8 fake devices of the test suite.
    """
    c.sft.train.steps = 4
    c.sft.model.init_from = ""
    c.sft.model.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8))
    for name in ("sft", "specialist_sft"):
        c[name].data.update(dict(seq_len=96, packing=False, batch_size=8))
    for s in (rl, *students):
        s.train.steps = 2
        s.eval.every = 1
        s.eval.n = 2
        s.rollout.prompts_per_step = 8
        s.rl.minibatches = 1
        s.rollout.sampling.update(dict(max_new_tokens=8, max_turns=2))
        s.eval.sampling.update(dict(max_new_tokens=8, max_turns=2))
    rl.rollout.group_size = 2
    c.eval.n = 2
    c.eval.sampling.update(dict(max_new_tokens=8, max_turns=2))
