"""Teacher registry, on-demand loading and routing for on-policy distillation."""
from opd_jax.teachers.bank import TeacherBank, TeacherSpec, model_bytes

__all__ = ["TeacherBank", "TeacherSpec", "model_bytes"]
