"""Cases 5-8 and the late/raw input errors: every JSONL record is checked at startup
(file:line), nothing trainable is refused, sequence lengths are checked against
max_position_embeddings (SFT, RL, generate), numeric ranges before any work, and a dict
literal for a config section checks its keys."""
import json
import os

import pytest

from opd_jax.cli import main
from opd_jax.config import ConfigError, load_config
from opd_jax.data.sft import scan_examples
from opd_jax.models import ModelConfig, synthetic_tokenizer
from opd_jax.rollout import generate
from opd_jax.trainers import builders
from opd_jax.trainers.run_policy import train_policy
from opd_jax.trainers.run_sft import train_sft
from tests.faults.conftest import GOOD, ROOT, SFT, TINY, snapshot, sft_cfg
from tests.models.helpers import random_model

JSONL = ["--config.data.source=jsonl"]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _sft_jsonl(path, *extra):
    return sft_cfg(*JSONL, f"--config.data.path={path}", *extra)


def test_prompts_longer_than_seq_len_are_refused(tmp_path):
    data = _jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 40, "response": "y"}] * 8)
    kept = snapshot(data)
    with pytest.raises(ValueError, match=f"{data}: nothing to train on: none of its 8 "
                                         f"examples has a response token within "
                                         f"data.seq_len=16 tokens \\(e.g. {data}:1\\)"):
        train_sft(_sft_jsonl(data), str(tmp_path / "run"), progress=False)
    assert snapshot(data) == kept and not (tmp_path / "run").exists()


def test_some_long_examples_are_dropped_with_counts(tmp_path):
    records = [{"prompt": "1+1=", "response": "2"}] * 4 + [{"prompt": "x" * 40,
                                                             "response": "y"}]
    with pytest.warns(RuntimeWarning, match="data.jsonl: 1 of 5 examples dropped \\(no "
                                            "response token within data.seq_len=16, first "
                                            "data.jsonl:5\\); 0 truncated"):
        kept = scan_examples(records, synthetic_tokenizer(), seq_len=16, source="data.jsonl",
                             lines=[1, 2, 3, 4, 5], batch_size=4)
    assert kept == records[:4]


@pytest.mark.parametrize("content, match", [
    (b'{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": "b"}\n{"prompt": "q"}\n',
     ":3: missing 'response'"),
    (b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n',
     ":2: not UTF-8 \\(byte b'\\\\xe9' at column 16\\)"),
    (b'{"prompt": "a", "response": "b"}\n[1, 2]\n', ":2: expected a JSON object, got list"),
    (b'{"prompt": "a", "response": [{"txt": "b"}]}\n', ":1: 'response' must be a string or"),
    (b'{"messages": [{"role": "user"}]}\n', ":1: messages\\[0\\] needs a string 'role' and"),
])
def test_a_bad_record_fails_at_startup_naming_file_and_line(tmp_path, content, match):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content * 1)
    with pytest.raises(ValueError, match=f"{data}{match}"):
        train_sft(_sft_jsonl(data), str(tmp_path / "run"), progress=False)
    assert data.read_bytes() == content and not (tmp_path / "run").exists()


def test_sft_rows_past_max_position_embeddings(tmp_path):
    with pytest.raises(ValueError, match="data.seq_len=1024 tokens exceed the model's "
                                         "max_position_embeddings=512"):
        train_sft(sft_cfg("--config.data.seq_len=1024"), str(tmp_path / "run"),
                  progress=False)
    assert not (tmp_path / "run").exists()


def test_generate_past_max_position_embeddings():
    cfg = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32)
    model = random_model(cfg)
    with pytest.raises(ValueError, match="prompt 0 \\(20 tokens\\) \\+ "
                                         "max_new_tokens=13 exceeds the model's "
                                         "max_position_embeddings=32"):
        generate(model, [[1] * 20, [1, 2]], max_new_tokens=13)
    assert len(generate(model, [[1] * 20], max_new_tokens=12).tokens[0]) <= 12


GRPO = os.path.join(ROOT, "opd_jax/configs/grpo.py:tiny")


@pytest.mark.parametrize("override, match", [
    ("--config.rollout.sampling.max_new_tokens=0",
     "rollout.sampling.max_new_tokens=0: expected an int >= 1"),
    ("--config.rollout.seq_len=2048",
     "rollout.seq_len=2048 tokens exceed the model's max_position_embeddings=512"),
    ("--config.rollout.sampling.max_new_tokens=600",
     "rollout.sampling.max_new_tokens=600: expected fewer than "
     "model.max_position_embeddings=512"),
    ("--config.optim.lr=-0.001", "optim.lr=-0.001: expected a finite number > 0"),
    ("--config.train.steps=0", "train.steps=0: expected an int >= 1"),
    # issue 30: evaluation values failed only after training, losing the last iteration
    ("--config.eval.batch_size=0", "eval.batch_size=0: expected an int >= 1"),
    ("--config.eval.sampling.top_p=2.0", "eval.sampling.top_p=2.0: expected a number in "
                                         "\\(0, 1\\]"),
    ("--config.rollout.sampling.top_k=-1", "rollout.sampling.top_k=-1: expected an int >= 0"),
    ("--config.eval.n=0", "eval.n=0: expected an int >= 1"),
])
def test_policy_configs_are_checked_before_work(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        train_policy(load_config(GRPO, [override]), str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


def test_kimi_batch_reuse_without_the_ppo_ratio_is_refused(tmp_path):
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"),
                      ["--config.rl.ppo_epochs=2"])
    with pytest.raises(ValueError, match=r"rl.ppo_epochs=2 with kimi_mopd ppo=False.*"
                                         r"--config.objective.options.ppo=True"):
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


def test_greedy_rl_warns():
    with pytest.warns(RuntimeWarning, match="rollout.sampling.temperature=0: RL samples "
                                            "greedily.*gradient vanishes"):
        builders.setup(load_config(GRPO, ["--config.rollout.sampling.temperature=0"]))


@pytest.mark.parametrize("override, match", [
    ("--config.optim.lr=-1", "optim.lr=-1.0: expected a finite number > 0"),
    ("--config.optim.lr=1e999", "optim.lr=inf: expected a finite number > 0"),
    ("--config.train.steps=0", "train.steps=0: expected an int >= 1"),
    ("--config.train.ckpt_every=0", "train.ckpt_every=0: expected an int >= 1"),
    ("--config.data.batch_size=6", "data.batch_size=6: expected a multiple of "
                                   "optim.grad_accum=4"),
    # issue 30 case 6: these trained silently wrong (min_lr_ratio=-3: gradient ascent)
    ("--config.optim.min_lr_ratio=-3.0", "optim.min_lr_ratio=-3.0: expected a number in "
                                         "[0, 1] (the cosine schedule's floor"),
    ("--config.optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5: expected a number in [0, 1]"),
    ("--config.optim.b1=-0.1", "optim.b1=-0.1: expected a number in [0, 1)"),
    ("--config.optim.b2=1.5", "optim.b2=1.5: expected a number in [0, 1)"),
    ("--config.optim.weight_decay=-0.01", "optim.weight_decay=-0.01: expected a finite number >= 0"),
    ("--config.optim.eps=0.0", "optim.eps=0.0: expected a finite number > 0"),
    ("--config.optim.grad_clip=-1.0", "optim.grad_clip=-1.0: expected a finite number >= 0"),
    ("--config.optim.schedule=linear", "optim.schedule='linear': expected one of "
                                       "'cosine', 'constant'"),
])
def test_numeric_ranges_one_line_before_any_work(tmp_path, capsys, override, match):
    workdir = tmp_path / "run"
    argv = ["sft", "--config", SFT, *TINY, *GOOD, "--config.optim.grad_accum=4", override,
            "--workdir", str(workdir), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {match}") and err.count("\n") == 1
    assert not workdir.exists()


def test_a_dict_literal_for_a_section_checks_its_keys():
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr' \\(did you mean "
                                          "'lr'\\?\\)"):
        load_config(SFT, ["--config.optim={'lrr': 1e-3}"])
    with pytest.raises(ConfigError, match="'optim.lr' expects float, got str"):
        load_config(SFT, ["--config.optim={'lr': 'fast'}"])
    cfg = load_config(SFT, ["--config.optim={'lr': 1e-3, 'b2': 0.99}"])
    assert (cfg.optim.lr, cfg.optim.b2, cfg.optim.b1) == (1e-3, 0.99, 0.9)   # others kept


def test_a_config_file_that_raises_is_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import ml_collections\nX = 1 / 0\n")
    assert main(["sft", "--config", str(bad), "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: config file '{bad}' failed to import: line 2: "
                   f"ZeroDivisionError: division by zero\n")
    bad.write_text("def get_config():\n    return {}['missing_section']\n")
    with pytest.raises(ConfigError, match="get_config\\(''\\) raised|unknown preset"):
        load_config(str(bad))
    bad.write_text("def get_config(:\n")
    with pytest.raises(ConfigError, match="failed to import: line 1: SyntaxError"):
        load_config(str(bad))


def test_a_broken_hf_config_names_the_file(tmp_path):
    from opd_jax.models import ModelRef, save_pretrained
    folder = tmp_path / "hf"
    save_pretrained(random_model(ModelConfig.preset("tiny")), str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{folder}/config.json: missing key 'hidden_size'"):
        ModelRef(str(folder)).model_config()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{folder}/config.json: not valid JSON"):
        ModelRef(str(folder)).model_config()


def test_text_the_tokenizer_cannot_represent_is_counted(tmp_path):
    """Issue 30 case 5: Chinese and emoji trained on <unk> with no warning."""
    tok = synthetic_tokenizer()
    mostly = [{"prompt": "q", "response": "你好世界🙂"}] * 4
    with pytest.raises(ValueError, match="data.jsonl: 20 of 32 tokens \\(62.5%\\) are the "
                                         "tokenizer's unknown token .*first at data.jsonl:1; "
                                         "20 of 24 trained tokens: most of what"):
        scan_examples(mostly, tok, seq_len=16, source="data.jsonl", lines=[1, 2, 3, 4])
    some = [{"prompt": "1+1=", "response": "2"}] * 3 + [{"prompt": "é?", "response": "2"}]
    with pytest.warns(RuntimeWarning, match="1 of 26 tokens \\(3.8%\\) are the tokenizer's "
                                            "unknown token .*first at data.jsonl:4; 0 of 8 "
                                            "trained tokens"):
        kept = scan_examples(some, tok, seq_len=16, source="data.jsonl", lines=[1, 2, 3, 4])
    assert kept == some


def test_grpo_warns_when_rewards_never_vary():
    """Issue 30: GRPO whose rewards never vary trained at loss 0 with no warning."""
    import warnings as w
    import numpy as np
    from opd_jax.trainers.phases import Batcher
    cfg = load_config(GRPO)
    b = Batcher(cfg, ModelConfig.preset("tiny"))
    G = cfg.rollout.group_size
    tied = np.zeros(2 * G, np.float32)
    varied = np.concatenate([np.zeros(G), np.eye(1, G)[0]]).astype(np.float32)
    with w.catch_warnings():
        w.simplefilter("error")
        for r in (tied, tied, varied, tied, tied):   # a varied iteration resets the count
            b.watch_flat(r)
    with pytest.warns(RuntimeWarning, match=f"rewards of every group of {G} rollouts tied "
                                            f"for 3 iterations in a row \\(values \\[0.0\\]\\): "
                                            f"every advantage is 0"):
        b.watch_flat(tied)
