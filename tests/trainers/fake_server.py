"""An inference server on 127.0.0.1 that answers the three served-teacher protocols (vLLM
`prompt_logprobs`, SGLang `/generate`, OpenAI-style `echo` + `logprobs`) from an in-process
model, in their documented response formats, with switches that reproduce known server bugs:

    shift        echo log-probs shifted by one position (llama-cpp-python 0.3)
    raw_temp     log-probs at T = 1 whatever the request's temperature (vLLM raw_logprobs)
    no_logprobs  answers without log-probs
    other_vocab  token strings of another vocabulary
    fail_first   the first N requests answer HTTP 503
    delay_s      every answer waits this long (timeouts)
"""
from __future__ import annotations

import http.server
import json
import threading
import time

import jax
import numpy as np

from opd_jax.losses import log_softmax


class FakeServer:
    def __init__(self, model, tokenizer, **bugs):
        self.model, self.tok = model, tokenizer
        self.bugs = dict(shift=False, raw_temp=False, no_logprobs=False, other_vocab=False,
                         no_top=False,
                         fail_first=0, delay_s=0.0) | bugs
        self.requests: list[tuple[str, dict]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body))
                if len(server.requests) <= server.bugs["fail_first"]:
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"warming up")
                    return
                time.sleep(server.bugs["delay_s"])
                try:
                    out = server.answer(self.path, body)
                except KeyError as e:
                    self.send_response(400)
                    self.end_headers()
                    self.wfile.write(f"bad request: {e}".encode())
                    return
                data = json.dumps(out).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):   # the client timed out
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    # the model's log-probs --------------------------------------------------------------
    def logprobs(self, ids, temperature) -> np.ndarray:
        """[L, V]: row j is the distribution of token j given tokens < j (row 0 unused)."""
        t = 1.0 if self.bugs["raw_temp"] else float(temperature)
        logits = self.model(jax.numpy.asarray([ids], jax.numpy.int32))[0]
        lp = np.asarray(log_softmax(logits, t), np.float64)          # [L, V]: next token
        return np.concatenate([np.zeros((1, lp.shape[1])), lp[:-1]])

    def string(self, i: int) -> str:
        s = self.tok.decode([int(i)])
        return ("<" + s + ">") if self.bugs["other_vocab"] else s

    def answer(self, path: str, body: dict):
        if path == "/v1/completions" and "prompt_logprobs" in body:
            return self.vllm(body)
        if path == "/generate":
            return self.sglang(body)
        if path == "/v1/completions":
            return self.openai(body)
        raise KeyError(path)

    def vllm(self, body):
        prompts = body["prompt"]
        prompts = prompts if isinstance(prompts[0], list) else [prompts]
        k, choices = int(body["prompt_logprobs"]), []
        for n, ids in enumerate(prompts):
            lp = self.logprobs(ids, body.get("temperature", 1.0))
            plp = [None]
            for j in range(1, len(ids)):
                order = np.argsort(-lp[j])
                rank = {int(t): r + 1 for r, t in enumerate(order)}
                keep = {int(t) for t in order[:k]} | {int(ids[j])}
                plp.append({str(t): {"logprob": float(lp[j, t]), "rank": rank[t],
                                     "decoded_token": self.string(t)} for t in keep})
            choice = {"index": n, "text": "x", "logprobs": None, "finish_reason": "length"}
            if not self.bugs["no_logprobs"]:
                choice["prompt_logprobs"] = plp
            choices.append(choice)
        return {"id": "cmpl-1", "object": "text_completion", "choices": choices}

    def sglang(self, body):
        rows, k, out = body["input_ids"], int(body["top_logprobs_num"]), []
        rows = rows if isinstance(rows[0], list) else [rows]
        for ids in rows:
            lp = self.logprobs(ids, body["sampling_params"].get("temperature", 1.0))
            tok = [[None, int(ids[0]), self.string(ids[0])]] + [
                [float(lp[j, ids[j]]), int(ids[j]), self.string(ids[j])]
                for j in range(1, len(ids))]
            # no_top: a server that ignores top_logprobs_num (sampled tokens only)
            top = [None] + [[[float(lp[j, t]), int(t), self.string(t)]
                             for t in np.argsort(-lp[j])[:0 if self.bugs["no_top"] else k]]
                            for j in range(1, len(ids))]
            meta = {"prompt_tokens": len(ids), "completion_tokens": 1}
            if not self.bugs["no_logprobs"]:
                meta |= {"input_token_logprobs": tok, "input_top_logprobs": top}
            out.append({"text": "x", "meta_info": meta})
        return out

    def openai(self, body):
        """llama-cpp-python's /v1/completions: a text prompt (or ids), `echo` and `logprobs`;
        with `shift` the echoed distributions sit one index early, as that server's do when
        the prompt does not open with the model's BOS (its generation path stays right)."""
        prompt, k, t = body["prompt"], int(body["logprobs"]), body.get("temperature", 1.0)
        ids = prompt if isinstance(prompt, list) else self.tok.encode(prompt)
        lp = self.logprobs(list(ids), t)                 # row j: the dist of token j
        logits = self.model(jax.numpy.asarray([ids], jax.numpy.int32))[0]
        nxt = np.asarray(log_softmax(logits[-1], 1.0 if self.bugs["raw_temp"] else t),
                         np.float64)
        gen = int(np.argmax(nxt))
        top_of = lambda d: {self.string(x): float(d[x]) for x in np.argsort(-d)[:k]}  # noqa
        if not body.get("echo"):
            logprobs = {"tokens": [self.string(gen)], "token_logprobs": [float(nxt[gen])],
                        "top_logprobs": [top_of(nxt)], "text_offset": [0]}
        else:
            dists = [lp[j] for j in range(len(ids))] + [nxt]  # dists[j]: token j's
            if self.bugs["shift"]:
                dists = dists[1:] + [nxt]
            seq = list(ids) + [gen]
            vals = [None] + [float(dists[j][seq[j]]) for j in range(1, len(seq))]
            top = [None] + [top_of(dists[j]) | {self.string(seq[j]): float(dists[j][seq[j]])}
                            for j in range(1, len(seq))]
            logprobs = {"tokens": [self.string(i) for i in seq], "token_logprobs": vals,
                        "top_logprobs": top, "text_offset": list(range(len(seq)))}
        choice = {"index": 0, "text": "x",
                  "logprobs": None if self.bugs["no_logprobs"] else logprobs}
        return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}
