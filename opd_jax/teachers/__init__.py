"""Teacher registry, on-demand loading and routing for on-policy distillation."""
from opd_jax.teachers.bank import TeacherBank, TeacherSpec, model_bytes
from opd_jax.teachers.merge import merge_models
from opd_jax.teachers.routing import check_routing, teacher_weights

__all__ = ["TeacherBank", "TeacherSpec", "check_routing", "merge_models", "model_bytes",
           "teacher_weights"]
