"""The real-architecture smoke path (`python -m studies.smoke`): Llama-3.2-1B and Qwen3-0.6B
shapes with 2 layers, random bf16 weights, the real Qwen tokenizer, through HF export, one SFT
step, one OPD iteration and a greedy generate.

Runs `python -m studies.smoke` in a subprocess with one CPU device (the suite's
8 fake devices would not split its batch of 2 rows, and would hold 8 replicas)."""
import json
import math
import os
import subprocess
import sys

import pytest

from studies.smoke import ARCHS

NEW_TOKENS = 6      # run_arch's default


def _run_smoke(out) -> None:
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "studies.smoke", "--out", str(out),
                           "--layers", "2"], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "llama3.2-1b | 2 |" in proc.stdout and "qwen3-0.6b | 2 |" in proc.stdout


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory):
    """One smoke run per test session: under pytest-xdist the workers share it through a
    file lock (two concurrent runs of the 1B-shaped models need ~23 GiB and get OOM-killed
    on a 24 GiB machine)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        out = tmp_path_factory.mktemp("smoke")
        _run_smoke(out)
    else:
        import filelock
        out = tmp_path_factory.getbasetemp().parent / f"smoke-{uid}"
        with filelock.FileLock(str(out) + ".lock"):
            if not (out / "smoke.json").is_file():
                out.mkdir(exist_ok=True)
                _run_smoke(out)
    with open(out / "smoke.json", encoding="utf-8") as f:
        rows = {r["arch"]: r for r in json.load(f)}
    return out, rows


@pytest.mark.slow
def test_both_architectures_ran(smoke_rows):
    _, rows = smoke_rows
    assert sorted(rows) == sorted(ARCHS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_sft_opd_generate(smoke_rows, arch):
    _, rows = smoke_rows
    r = rows[arch]
    # Random init over ~151k ids: the SFT loss is near ln(vocab) and finite.
    assert math.isfinite(r["sft_loss"]) and abs(r["sft_loss"] - math.log(151_669)) < 1.5
    opd = r["opd"]
    assert math.isfinite(opd["loss"]) and opd["tokens"] > 0
    # Teacher = the student's own folder: the reverse KL of identical models is ~0, so a
    # misaligned teacher score (positions, prompts, tokenizer) would show up here.
    assert abs(opd["loss"]) < 1e-3, opd
    g = r["generate"]
    assert len(g["tokens"]) == NEW_TOKENS and g["finish"] == "length"
    assert isinstance(g["text"], str) and g["text"]
    assert all(r["finite"].values()), r["finite"]


@pytest.mark.slow
def test_exported_configs_have_the_real_fields(smoke_rows):
    out, rows = smoke_rows
    with open(out / "llama3.2-1b" / "hf" / "config.json", encoding="utf-8") as f:
        llama = json.load(f)
    assert llama["model_type"] == "llama" and llama["hidden_size"] == 2048
    assert llama["rope_parameters"]["rope_type"] == "llama3"
    assert llama["rope_parameters"]["factor"] == 32.0
    assert llama["num_attention_heads"] == 32 and llama["num_key_value_heads"] == 8
    assert llama["head_dim"] == 64 and llama["intermediate_size"] == 8192
    assert llama["num_hidden_layers"] == 2 and llama["tie_word_embeddings"] is True
    assert llama["vocab_size"] == 151_669            # the Qwen tokenizer's size (stand-in)
    with open(out / "qwen3-0.6b" / "hf" / "config.json", encoding="utf-8") as f:
        qwen = json.load(f)
    assert qwen["model_type"] == "qwen3" and qwen["hidden_size"] == 1024
    assert qwen["num_key_value_heads"] == 8 and qwen["head_dim"] == 128
    assert qwen["vocab_size"] == 151_936 and qwen["rope_theta"] == 1_000_000.0
    # transformers read both configs back from the local folders.
    assert rows["llama3.2-1b"]["export"]["autoconfig_class"] == "LlamaConfig"
    assert rows["llama3.2-1b"]["export"]["rope_type"] == "llama3"
    assert rows["qwen3-0.6b"]["export"]["autoconfig_class"] == "Qwen3Config"
    assert rows["qwen3-0.6b"]["export"]["num_key_value_heads"] == 8
