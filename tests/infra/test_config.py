import pytest

from opd_jax.cli import main
from opd_jax.config import ConfigError, load_config

SFT = "configs/sft.py"


def test_presets_and_overrides():
    cfg = load_config(f"{SFT}:tiny", ["--config.optim.lr=1e-3", "--config.train.steps=7",
                                      "--config.data.packing=True", "--config.tokenizer=foo",
                                      "--config.mesh.shape=(2,2,2)"])
    assert cfg.optim.lr == 1e-3 and cfg.train.steps == 7 and cfg.data.packing is True
    assert cfg.tokenizer == "foo" and tuple(cfg.mesh.shape) == (2, 2, 2)
    assert load_config(SFT).data.source == "synthetic"           # default preset
    assert load_config(f"{SFT}:jsonl").data.source == "jsonl"


def test_dict_replaces_a_map_section():
    cfg = load_config("configs/opd.py:kimi_mopd",
                      ["--config.teachers.paths={'general/max': 'runs/a', 'coding/max': 'runs/b'}"])
    assert dict(cfg.teachers.paths) == {"general/max": "runs/a", "coding/max": "runs/b"}


def test_int_widens_to_float():
    cfg = load_config(SFT, ["--config.optim.lr=1"])
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 1.0


@pytest.mark.parametrize("override, match", [
    ("--config.optim.lrr=1", "unknown config key 'optim.lrr' \\(did you mean 'lr'\\?\\)"),
    ("--config.nope.lr=1", "unknown config key 'nope'"),
    ("--config.train.steps=abc", "'train.steps' expects int, got str 'abc'"),
    ("--config.train.steps=1.5", "'train.steps' expects int, got float"),
    ("--config.optim=3", "is a section"),
    ("--config.optim.lr={'a': 1}", "'optim.lr' expects float, got dict"),
    ("--config.optim.lr", "expected --config.key=value"),
])
def test_bad_overrides(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SFT, [override])


def test_missing_file_and_preset():
    with pytest.raises(ConfigError, match="config file 'configs/nope.py' does not exist"):
        load_config("configs/nope.py")
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_config(f"{SFT}:huge")


def test_cli_one_line_errors(capsys):
    assert main(["sft", "--config", SFT, "--config.optim.lrr=1", "--workdir", "/tmp/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown config key 'optim.lrr'") and "\n" not in err
    assert main(["sft", "--config", "nope.py", "--workdir", "/tmp/x"]) == 2
    assert "does not exist" in capsys.readouterr().err
