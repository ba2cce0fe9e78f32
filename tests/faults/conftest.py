"""Shared pieces of the fault suite: a tiny SFT run to damage (copied per test), file
snapshots to prove nothing good on disk changed, and the tiny config overrides."""
import hashlib
import os
import shutil

import pytest

from opd_jax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT = os.path.join(ROOT, "opd_jax/configs/sft.py:tiny")
TINY = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
        "--config.model.num_layers=1", "--config.model.head_dim=8",
        "--config.data.batch_size=8", "--config.data.seq_len=16", "--config.train.log_every=1",
        "--config.optim.warmup_steps=2"]
# The good run: 8 steps, checkpoints 4 and 8.
GOOD = ["--config.train.steps=8", "--config.train.ckpt_every=4"]


def sft_cfg(*extra):
    return load_config(SFT, TINY + GOOD + list(extra))


def snapshot(path) -> dict[str, str]:
    """{relative path: sha256} of every file under `path` (a file: just it)."""
    path = str(path)
    if os.path.isfile(path):
        return {"": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def checkpoint_snapshot(workdir) -> dict[str, str]:
    """Snapshots of the checkpoints and config.json (not metrics or the lock file)."""
    out = {f"checkpoints/{k}": v
           for k, v in snapshot(os.path.join(workdir, "checkpoints")).items()}
    out["config.json"] = snapshot(os.path.join(workdir, "config.json"))[""]
    return out


@pytest.fixture(scope="session")
def good_run(tmp_path_factory):
    """(workdir, result) of an intact tiny SFT run; copy it before damaging it."""
    from opd_jax.trainers.run_sft import train_sft
    workdir = tmp_path_factory.mktemp("faults") / "good"
    out = train_sft(sft_cfg(), str(workdir), progress=False)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "8"]
    return workdir, out


@pytest.fixture
def run_copy(good_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(good_run[0], workdir)
    return workdir
