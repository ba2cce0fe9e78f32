"""Child of the rollout SIGKILL test: the CLI with each token-log commit slowed, so the
parent can kill it mid-rollout.   python rollout_kill_child.py <opd-jax args>"""
import sys
import time

from opd_jax.episodes import wal

_commit = wal.TokenLog.commit


def _slow_commit(self):
    _commit(self)
    time.sleep(0.15)


wal.TokenLog.commit = _slow_commit

if __name__ == "__main__":
    from opd_jax.cli import main
    sys.exit(main(sys.argv[1:]))
