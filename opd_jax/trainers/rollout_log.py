"""A training run's rollout token logs (`workdir/rollout_wal/iter_<iteration>.wal`).

The policy driver (`opd_jax.trainers.run_policy`) hands `play()` one token write-ahead log
per iteration (`opd_jax.episodes.wal`), so a run killed mid-rollout resumes from its last
checkpoint without sampling a logged token again (docs/robustness.md).
"""
from __future__ import annotations

import os


class RolloutLog:
    """A training run's rollout token logs: `workdir/rollout_wal/iter_<iteration>.wal`.

    One log per iteration since the last checkpoint. A run killed mid-rollout resumes from
    its checkpoint, replays the iterations after it (their logs hold every token, so
    nothing is sampled again) and continues the interrupted rollout from its last commit.
    `every`: decode steps per commit; 0 (or several processes) keeps no log.
    """

    def __init__(self, workdir: str, every: int, *, start: int, enabled: bool = True,
                 reset: bool = False):
        if every < 0:
            raise ValueError(f"rollout.wal_every={every}: expected >= 0 (0 = no log)")
        self.dir, self.every = os.path.join(workdir, "rollout_wal"), every if enabled else 0
        self.stats: dict = {}
        self.last_checkpoint = start
        if self.every:
            os.makedirs(self.dir, exist_ok=True)
            # logs a checkpoint covers; all of them when the run's settings changed
            self.prune(None if reset else start)

    def kwargs(self, iteration: int, step: int) -> dict:
        """play() keyword arguments for this iteration's rollout."""
        self.stats = {}
        if not self.every:
            return {"stats": self.stats}
        return dict(wal_path=os.path.join(self.dir, f"iter_{iteration:06d}.wal"),
                    steps_per_call=self.every, stats=self.stats,
                    identity={"iteration": int(iteration), "step": int(step)})

    def prune(self, done: int | None) -> None:
        """Remove the logs of iterations before `done` (None: every log)."""
        if not self.every:
            return
        for name in os.listdir(self.dir):
            if name.startswith("iter_") and name.endswith(".wal") and (
                    done is None or int(name[5:-4]) < done):
                os.remove(os.path.join(self.dir, name))

    def checkpointed(self, done: int) -> None:
        """A checkpoint of `done` iterations was written: drop the logs the one before it
        covers (a save may still be finishing when the run is killed)."""
        self.prune(self.last_checkpoint)
        self.last_checkpoint = done
