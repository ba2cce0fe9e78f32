"""Orbax checkpoints of train state + data iterator + JSON metadata (`manager`), their
per-array checksums (`digest`) and the workdir lock (`lock`)."""
from opd_jax.checkpoint.digest import (DIGEST_BLOCK, CheckpointError, _leaf_digest,  # noqa: F401
                                       state_digest, verify_digest)
from opd_jax.checkpoint.lock import WorkdirError, WorkdirLock, prepare_workdir
from opd_jax.checkpoint.manager import (Checkpointer, abstract_like,
                                        latest_step_dir, read_step_meta, restore_params,
                                        step_dirs)

__all__ = ["DIGEST_BLOCK", "CheckpointError", "Checkpointer", "WorkdirError", "WorkdirLock",
           "abstract_like", "latest_step_dir", "step_dirs", "prepare_workdir", "read_step_meta",
           "restore_params", "state_digest", "verify_digest"]
