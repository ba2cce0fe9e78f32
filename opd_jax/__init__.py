"""opd_jax: on-policy distillation and RL post-training in JAX."""
__version__ = "0.1.0"
