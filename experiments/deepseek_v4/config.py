"""DeepSeek-V4 recipe: specialists per domain and effort -> one student by weighted
full-vocabulary reverse-KL OPD, teachers loaded on demand into a cache smaller than the bank.

Run (from the repository root):

    opd-jax experiment --config experiments/deepseek_v4/config.py:reduced --workdir runs/deepseek_v4

The specialists, the merges, the evaluation and every claim are kimi_k3's
(experiments/kimi_k3/config.py, the same preset): per domain a specialist SFT, then GRPO at
max effort annealed down to high and low; the task-arithmetic merge chosen on a validation
draw; the student from the merge. What differs is the student: DeepSeek-V4's objective, the
reverse KL to its routed teacher over the whole vocabulary (`deepseek_full_vocab`: the fused
kernel, teacher last-layer hidden states cached per batch, logits recomputed chunk by chunk),
with at most 2 teachers loaded at once (6 in the bank: loads, evictions and hits in
``seed*/student/teacher_cache.json`` and results.md). Beside it, ``sampled_student``: Kimi's
clipped sampled-token student, kimi_k3's own student stage, from the same merge with the
same rollouts and optimizer steps, so the claim "the full-vocabulary student beats it at equal
compute" is measured. Presets: ``reduced`` (1 seed; ``--config.seeds="(0,1,2)"`` for the
table; with the mixed-data baseline at 120 GRPO iterations), ``full`` (3 domains x 3
efforts, the mixed-data baseline, 3 seeds), ``smoke``
(tests), ``scale_v5p64`` / ``scale_8xh100`` (real sizes, compile-checked, not run:
``python -m studies.scale_estimate --config experiments/deepseek_v4/config.py:scale_8xh100``).

A run shares its specialists with a kimi_k3 run of the same preset and seeds: their stages
have the same configs, so copying a kimi_k3 workdir's ``seed*/{sft_*,rl_*,merge_*}`` into this
one's makes the pipeline reuse them (it re-runs a stage whose config differs).
"""
import os

import ml_collections

from opd_jax.config import load_config
from opd_jax.recipes import trainer_config as base

KIMI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kimi_k3", "config.py")
# The full-vocabulary student's schedule, from the student sweep's rounds 3 and 4 on seed 0
# (experiments/kimi_k3/student_sweep_round4): see experiments/deepseek_v4/README.md.
STUDENT_LR = 3e-4
MAX_LOADED = 2          # teachers held at once (the bank: 6 in reduced, 9 in full and at scale)


def get_config(arg: str = "reduced") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict(load_config(f"{KIMI}:{arg}").to_dict())
    c.recipe = "deepseek_v4"
    c.sampled_student = ml_collections.ConfigDict(c.student.to_dict())
    c.student.objective = base("opd.py:deepseek_full_vocab").objective
    if arg in ("reduced", "full"):
        c.student.optim.lr = STUDENT_LR
    if arg == "reduced":
        # The mixed-data baseline (issue 32), off in kimi_k3's reduced main job: SFT on both
        # domains' demos (200 steps), then 120 GRPO iterations on all 6 cells. At the reduced
        # preset that matches the specialists' and the student's FLOPs (3.4e13 per seed on
        # each side, ratio 0.99: experiments/kimi_k3/mixed_reduced).
        c.mixed_rl_steps = 120
    for name in ("student", "sampled_student"):     # smoke: 2 teachers, so 1 loaded at once
        c[name].teachers.max_loaded = 1 if arg == "smoke" else MAX_LOADED
    return c
