"""The episode layer, below trainers and teachers: play tasks with a policy on the rollout
engine (`play`, with a token write-ahead log so a killed rollout resumes), the episode
record, the one prompt rule (`prompt_ids`), and the shifted sequence batch that trainers and
teachers both score (`build_sequences`, `align_to_student`).

    from opd_jax.episodes import SamplingConfig, play
    episodes = play(model, tokenizer, tasks, SamplingConfig(max_new_tokens=64), seed=0)
"""
from opd_jax.episodes.episode import Episode, SamplingConfig, encode, prompt_ids
from opd_jax.episodes.runner import play
from opd_jax.episodes.sequences import align_to_student, build_sequences

__all__ = ["Episode", "SamplingConfig", "align_to_student", "build_sequences", "encode",
           "play", "prompt_ids"]
