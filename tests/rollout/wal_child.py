"""Child process for the SIGKILL test: generate with a token log, slowed between chunks.

    python wal_child.py LOG_PATH   (prints nothing; the parent kills it mid-generation)
"""
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")

from rollout_fixtures import random_model

from opd_jax.rollout import generate, wal

PROMPTS = [[1, 20, 30, 40, 50], [1, 60], [1, 70, 80], [1, 9, 9, 9]]
KW = dict(max_new_tokens=[24, 40, 32, 40], temperature=1.0, top_p=0.95, seed=11,
          stop_token_ids=[7], max_len=64, steps_per_call=2)

if __name__ == "__main__":
    slow = wal._log_chunk

    def log_then_sleep(*args):  # leave the parent time to kill between commits
        slow(*args)
        time.sleep(0.3)
    wal._log_chunk = log_then_sleep
    generate(random_model(seed=0), PROMPTS, wal_path=sys.argv[1], **KW)
