"""Fused Pallas kernels for full-vocabulary distillation losses (importable without opd_jax).

    kl_N = fused_reverse_kl(h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, implementation="auto")
    lp_s, lp_t, r = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, targets_N, r_max=5.0)
"""
from pallas_kernels.api import fused_clipped_log_ratio, fused_reverse_kl, fused_reverse_kl_loss
from pallas_kernels.reference import clipped_log_ratio_reference, reverse_kl_reference

__all__ = ["fused_reverse_kl", "fused_reverse_kl_loss", "fused_clipped_log_ratio", "reverse_kl_reference",
           "clipped_log_ratio_reference"]
