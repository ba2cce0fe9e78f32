"""Teacher registry, on-demand loading, routing and scoring for on-policy distillation."""
from opd_jax.teachers.bank import TeacherBank
from opd_jax.teachers.merge import merge_models
from opd_jax.teachers.routing import check_routing, teacher_weights
from opd_jax.teachers.scoring import (TeacherScorer, TeacherScores, in_row_chunks,
                                      teacher_fields)

__all__ = ["TeacherBank", "TeacherScorer", "TeacherScores", "check_routing", "in_row_chunks", "merge_models",
           "teacher_fields", "teacher_weights"]
