"""The trainer configs ship inside the package: ``configs/NAME.py[:preset]`` names the
packaged file when no such path exists relative to the current directory, and a user's
config at an existing path is used as given."""
import os

import pytest

from opd_jax.config import PACKAGED_CONFIGS, ConfigError, load_config, resolve_config_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_configs_live_in_the_package():
    assert PACKAGED_CONFIGS == os.path.join(ROOT, "opd_jax", "configs")
    for name in ("sft.py", "grpo.py", "opd.py", "eval.py", "_sections.py"):
        assert os.path.isfile(os.path.join(PACKAGED_CONFIGS, name)), name
    assert not os.path.exists(os.path.join(ROOT, "configs"))


def test_configs_path_falls_back_to_the_packaged_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                    # no configs/ folder here
    assert not os.path.exists("configs")
    assert resolve_config_path("configs/sft.py") == os.path.join(PACKAGED_CONFIGS, "sft.py")
    cfg = load_config("configs/sft.py:tiny", ["--config.train.steps=3"])
    assert cfg.train.steps == 3
    assert cfg.to_dict() == load_config(os.path.join(PACKAGED_CONFIGS, "sft.py:tiny"),
                                         ["--config.train.steps=3"]).to_dict()
    # every packaged trainer config, through the sibling import of _sections.py
    for spec in ("configs/grpo.py:tiny", "configs/opd.py:kimi_mopd", "configs/eval.py",
                 "./configs/opd.py:deepseek_full_vocab"):
        load_config(spec)
    with pytest.raises(ConfigError, match="config file 'configs/nope.py' does not exist"):
        load_config("configs/nope.py")
    with pytest.raises(ConfigError, match="does not exist"):     # only configs/NAME.py falls back
        load_config("other/sft.py:tiny")


def test_a_user_config_at_an_existing_path_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("configs")
    # the user's own shared sections, imported as a sibling like the packaged ones
    (tmp_path / "configs" / "_sections.py").write_text("STEPS = 7\n")
    (tmp_path / "configs" / "sft.py").write_text(
        "import ml_collections\n"
        "from _sections import STEPS\n\n\n"
        "def get_config(arg='tiny'):\n"
        "    return ml_collections.ConfigDict(dict(preset=arg, train=dict(steps=STEPS)))\n")
    cfg = load_config("configs/sft.py:tiny")
    assert cfg.preset == "tiny" and cfg.train.steps == 7 and "optim" not in cfg
    # the packaged configs still load their own _sections.py, and the user's still wins after
    assert "optim" in load_config(os.path.join(PACKAGED_CONFIGS, "sft.py:tiny"))
    assert load_config("configs/sft.py").train.steps == 7
    # a name the user's folder lacks is the packaged one
    assert resolve_config_path("configs/grpo.py") == os.path.join(PACKAGED_CONFIGS, "grpo.py")
    assert "rollout" in load_config("configs/grpo.py:tiny")
