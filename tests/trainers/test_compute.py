"""Compute counts: tokens per part, FLOPs 2N / 2N_T / 6N per token, a JSON round trip, and a
clear error for a teacher whose size is unknown. (Their wiring into the trainers is checked
by the policy smoke, SFT and kill-and-resume tests.)"""
import pytest

from opd_jax.trainers import compute


def test_iteration_counts_and_flops(tmp_path):
    c = compute.Compute()
    c.add_iteration([10, 20], sampled=12, forward_passes=1, epochs=2,
                    teacher_rows={"a/max": [10], "b/max": [20]})
    c.add_iteration([5], sampled=3, forward_passes=1, epochs=2, teacher_rows={"a/max": [5]})
    assert (c.rollouts, c.rollout, c.sampled, c.forward, c.trained) == (3, 35, 15, 35, 70)
    assert c.teacher == {"a/max": 15, "b/max": 20}
    f = c.flops(100, {"a/max": 1000, "b/max": 10})
    assert f == {"rollout": 7000.0, "forward": 7000.0, "teacher": 30000.0 + 400.0,
                 "train": 42000.0, "total": 7000.0 + 7000.0 + 30400.0 + 42000.0}
    assert compute.Compute.from_dict(c.to_dict()) == c
    rec = compute.write(str(tmp_path), c, 100, {"a/max": 1000, "b/max": 10})
    assert compute.read(str(tmp_path)) == rec and rec["flops"] == f
    assert compute.read(str(tmp_path / "none")) is None
    with pytest.raises(ValueError, match=r"teacher_params lacks \['b/max'\]"):
        c.flops(100, {"a/max": 1000})


def test_sft_counts_every_position(tmp_path):
    import os

    from opd_jax.config import load_config
    from opd_jax.trainers.run_sft import train_sft
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "opd_jax/configs/sft.py:tiny"),
                      ["--config.train.steps=2", "--config.model.hidden_size=32",
                       "--config.model.intermediate_size=64", "--config.model.num_layers=1",
                       "--config.model.head_dim=8"])
    train_sft(cfg, str(tmp_path), progress=False)
    rec = compute.read(str(tmp_path))
    rows = 2 * cfg.data.batch_size * cfg.data.seq_len
    assert rec["tokens"]["trained"] == rows
    from opd_jax.trainers.builders import planned_model_config
    assert rec["params"] == planned_model_config(cfg.model).num_params()
    assert rec["flops"]["total"] == 6.0 * rec["params"] * rows
