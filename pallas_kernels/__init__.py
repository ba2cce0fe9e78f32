"""Fused Pallas kernels for full-vocabulary distillation losses (importable without opd_jax)."""
