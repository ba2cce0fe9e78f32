"""Teacher registry, on-demand loading, routing and scoring for on-policy distillation."""
from opd_jax.teachers.bank import TeacherBank, TeacherSpec, model_bytes
from opd_jax.teachers.merge import merge_models
from opd_jax.teachers.routing import check_routing, teacher_weights
from opd_jax.teachers.scoring import TeacherScorer, in_row_chunks, teacher_fields

__all__ = ["TeacherBank", "TeacherScorer", "TeacherSpec", "check_routing", "in_row_chunks",
           "merge_models", "model_bytes", "teacher_fields", "teacher_weights"]
