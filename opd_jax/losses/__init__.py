"""Functional losses for SFT, GRPO (+DAPO/Dr.GRPO/IcePop/TIS) and on-policy distillation.

Pure functions of arrays: jit-, vmap- and grad-friendly, mask-aware, fp32 inside. Every
loss returns `(loss, metrics)`: an fp32 scalar and a dict of fp32 scalars with stable names.

    from opd_jax.losses import token_logprobs, sft_loss, group_advantages, grpo_loss, \
        kimi_mopd_loss, glm_opd_loss, reverse_kl_loss, topk_kl_loss

Hidden-state forms (`*_from_hidden`) take last-layer hidden states and unembeddings and run
the fused `pallas_kernels`, so no [B, T, V] logits are built.

KL directions are in the names: reverse = KL(student || teacher), forward = KL(teacher || student).
"""
from opd_jax.losses.aggregation import AGGREGATIONS, aggregate, masked_mean
from opd_jax.losses.grpo import (dapo_group_filter, group_advantages, grpo_loss, kl_k3,
                                 overlong_penalty)
from opd_jax.losses.hidden import (glm_opd_loss_from_hidden, kimi_mopd_loss_from_hidden,
                                   reverse_kl_loss_from_hidden,
                                   sampled_token_logprobs_from_hidden)
from opd_jax.losses.kl import (forward_kl, forward_kl_loss, generalized_jsd,
                               generalized_jsd_loss, reverse_kl, reverse_kl_loss)
from opd_jax.losses.logprobs import log_softmax, token_entropy, token_logprobs
from opd_jax.losses.opd import clipped_log_ratio, glm_opd_loss, kimi_mopd_loss
from opd_jax.losses.policy import CORRECTIONS, Correction, mismatch_correction, ppo_clip
from opd_jax.losses.sft import sft_loss
from opd_jax.losses import kl, topk
from opd_jax.losses.topk import teacher_topk, topk_divergence, topk_kl_loss

__all__ = [
    "AGGREGATIONS", "CORRECTIONS", "Correction", "aggregate", "clipped_log_ratio", "dapo_group_filter",
    "forward_kl", "forward_kl_loss", "generalized_jsd", "generalized_jsd_loss", "glm_opd_loss",
    "glm_opd_loss_from_hidden", "kimi_mopd_loss_from_hidden", "reverse_kl_loss_from_hidden",
    "sampled_token_logprobs_from_hidden",
    "group_advantages", "grpo_loss", "kimi_mopd_loss", "kl_k3", "log_softmax", "masked_mean",
    "mismatch_correction", "overlong_penalty", "ppo_clip", "reverse_kl", "reverse_kl_loss",
    "sft_loss", "teacher_topk", "token_entropy", "token_logprobs", "kl", "topk", "topk_divergence", "topk_kl_loss",
]
