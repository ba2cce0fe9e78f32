"""Rollout engine: a jit sampler with KV cache, per-token sampler log-probs, stop ids and
strings, per-row max_new_tokens and think budgets, and pause/resume. Multi-turn episodes
with environments (and their token write-ahead log) run on it through
`opd_jax.episodes.play`.

    from opd_jax.rollout import generate
    res = generate(model, [[1, 5, 7]], max_new_tokens=32, temperature=0.7, seed=0)
    res.tokens, res.logprobs, res.finish_reasons
"""
from opd_jax.rollout.api import (
                                 GenerateResult,
                                 align_right,
                                 generate,
                                 resume,
                                 sample,
                                 stop_sequences,
                                 think_ids,
                                 to_result,
)
from opd_jax.rollout.engine import (
                                 RolloutBatch,
                                 RolloutState,
                                 decode,
                                 extend,
                                 init_state,
                                 pack,
)
from opd_jax.rollout.sampling import (
                                 NO_BUDGET,
                                 FinishReason,
                                 SamplingParams,
                                 process_logits,
                                 sample_logits,
)

__all__ = [
                                 "NO_BUDGET",
                                 "FinishReason",
                                 "GenerateResult",
                                 "RolloutBatch",
                                 "RolloutState",
                                 "SamplingParams",
                                 "align_right",
                                 "decode",
                                 "extend",
                                 "generate",
                                 "init_state",
                                 "pack",
                                 "process_logits",
                                 "resume",
                                 "sample",
                                 "sample_logits",
                                 "stop_sequences",
                                 "think_ids",
                                 "to_result",
]
