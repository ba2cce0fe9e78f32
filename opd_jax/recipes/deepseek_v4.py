"""DeepSeek-V4: specialists per domain and effort -> weighted full-vocabulary reverse-KL OPD.

The stages, the evaluation, the tables and the claims are `kimi_k3`'s (its module doc): the
recipe is that pipeline with the full-vocabulary objective as the student's
(``deepseek_full_vocab``: the fused kernel, teacher hidden states cached per batch, teachers
loaded on demand into a cache smaller than the bank) and Kimi's sampled-token student beside
it as ``sampled_student`` (same start, rollouts and optimizer steps), whose claim the report
adds. experiments/deepseek_v4/config.py builds the config from kimi_k3's presets.
"""
from __future__ import annotations

from opd_jax.recipes.kimi_k3 import build, claims, collect, plot, write_markdown

__all__ = ["build", "claims", "collect", "plot", "write_markdown"]
