"""Teacher registry, on-demand loading and routing for on-policy distillation."""
from opd_jax.teachers.bank import TeacherBank, TeacherSpec, model_bytes
from opd_jax.teachers.merge import merge_models

__all__ = ["TeacherBank", "TeacherSpec", "merge_models", "model_bytes"]
