"""SFT data: examples -> token ids + loss masks -> padded or packed batches (grain).

An *example* is a dict in one of two forms (JSONL lines use the same forms):

* ``{"prompt": str, "response": str | [{"text": str, "train": bool}, ...]}`` — the loss
  covers the response (plus EOS); response pieces with ``"train": false`` are masked out
  (GLM's "masked bad spans").
* ``{"messages": [{"role": ..., "content": ..., "train": bool?}, ...]}`` — rendered with the
  tokenizer's chat template; the loss covers assistant messages (unless ``"train": false``).

A *tokenized example* is ``{"tokens": int32[L], "loss_mask": int32[L]}`` where
``loss_mask[i]`` says whether ``tokens[i]`` is a training *target*. Batches hold inputs and
targets already shifted by one: ``inputs_BxT = tokens[:-1]``, ``targets_BxT = tokens[1:]``,
``mask_BxT = loss_mask[1:]``, plus ``segment_ids_BxT`` (0 = padding) and ``positions_BxT``.
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from opd_jax.models.tokenizers import bos_ids


def tokenize_example(example: Mapping[str, Any], tokenizer, *, add_bos: bool = True) -> dict:
    """Tokenize one example into ``{"tokens", "loss_mask"}`` (see module docstring)."""
    if "messages" in example:
        return _tokenize_chat(example["messages"], tokenizer)
    if "prompt" not in example or "response" not in example:
        raise ValueError(f"example needs 'prompt' and 'response' or 'messages'; got keys "
                         f"{sorted(example)}")
    ids: list[int] = []
    mask: list[int] = []
    if add_bos:
        ids += bos_ids(tokenizer)
        mask += [0] * len(ids)
    prompt = tokenizer.encode(example["prompt"], add_special_tokens=False)
    ids += prompt
    mask += [0] * len(prompt)
    pieces = example["response"]
    if isinstance(pieces, str):
        pieces = [{"text": pieces, "train": True}]
    for piece in pieces:
        toks = tokenizer.encode(piece["text"], add_special_tokens=False)
        ids += toks
        mask += [int(piece.get("train", True))] * len(toks)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def _tokenize_chat(messages: Sequence[Mapping[str, Any]], tokenizer) -> dict:
    """Render with the chat template; mask everything but trainable assistant turns.

    Each message's tokens are the difference between the template rendered up to and
    including it and the template rendered before it, so templates must be prefix-stable.
    """
    def render(msgs, gen_prompt):
        if not msgs:
            return []
        clean = [{"role": m["role"], "content": m["content"]} for m in msgs]
        return list(tokenizer.apply_chat_template(clean, tokenize=True,
                                                  add_generation_prompt=gen_prompt,
                                                  return_dict=False))
    ids: list[int] = []
    mask: list[int] = []
    for k, msg in enumerate(messages):
        is_target = msg["role"] == "assistant" and msg.get("train", True)
        # The assistant header belongs to the prompt side: render it with the previous turn.
        prefix = render(messages[:k], gen_prompt=msg["role"] == "assistant")
        full = render(messages[:k + 1], gen_prompt=False)
        if full[:len(ids)] != ids or prefix[:len(ids)] != ids:
            raise ValueError("chat template is not prefix-stable at message "
                             f"{k} (role {msg['role']!r}); cannot derive loss masks")
        ids_prefix_extra = prefix[len(ids):]
        ids += ids_prefix_extra
        mask += [0] * len(ids_prefix_extra)
        body = full[len(ids):]
        ids += body
        mask += [int(is_target)] * len(body)
    return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int32)}


def read_jsonl(path: str | os.PathLike, *, with_lines: bool = False
               ) -> list[dict] | tuple[list[dict], list[int]]:
    """Read a JSONL file of examples; errors name the file and line. ``with_lines``: also
    return each example's line number."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"JSONL data file {str(path)!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"JSONL data file {str(path)!r} is not a file")
    out, lines = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 (byte {raw[e.start:e.start + 1]!r} "
                                 f"at column {e.start + 1}); expected UTF-8 JSON lines"
                                 ) from None
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            lines.append(n)
    if not out:
        raise ValueError(f"JSONL data file {str(path)!r} holds no examples")
    return (out, lines) if with_lines else out


def check_example(ex: Any) -> None:
    """Raise ValueError unless `ex` has one of the two example forms (module docstring)."""
    if not isinstance(ex, Mapping):
        raise ValueError(f"expected a JSON object, got {type(ex).__name__}")
    if "messages" in ex:
        msgs = ex["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] needs a string 'role' and 'content'; got "
                                 f"{m!r:.80}")
        return
    missing = [k for k in ("prompt", "response") if k not in ex]
    if missing:
        raise ValueError(f"missing {' and '.join(repr(k) for k in missing)}: an example needs "
                         f"'prompt' and 'response', or 'messages'; got keys {sorted(ex)}")
    if not isinstance(ex["prompt"], str):
        raise ValueError(f"'prompt' must be a string, got {type(ex['prompt']).__name__}")
    pieces = ex["response"]
    if isinstance(pieces, str):
        return
    if not isinstance(pieces, list) or not all(
            isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in pieces):
        raise ValueError("'response' must be a string or a list of {\"text\": str, "
                         "\"train\": bool} pieces")


def scan_examples(examples: Sequence[Any], tokenizer, *, seq_len: int, source: str,
                  lines: Sequence[int] | None = None, packing: bool = False,
                  batch_size: int = 1) -> list[dict]:
    """Check and tokenize every example once, before training: the first bad record fails
    naming ``source:line``; examples with no trained token within the first `seq_len`
    targets (a prompt longer than the row) are dropped with a warning giving the counts;
    nothing trainable left is an error. Text the tokenizer cannot represent (its <unk>) is
    counted: any is a warning with the share and the first line, a majority of the trained
    tokens is an error (the model would learn to write <unk>)."""
    where = (lambda i: f"{source}:{lines[i]}") if lines else (lambda i: f"{source} record {i}")
    kept, dropped, truncated = [], [], 0
    unk = getattr(tokenizer, "unk_token_id", None)
    n_unk = n_tok = n_trained = n_trained_unk = 0
    first_unk = None
    for i, ex in enumerate(examples):
        try:
            check_example(ex)
            tok = tokenize_example(ex, tokenizer)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where(i)}: {e}") from None
        if unk is not None:
            is_unk = tok["tokens"] == unk
            n_unk, n_tok = n_unk + int(is_unk.sum()), n_tok + len(is_unk)
            trained = tok["loss_mask"].astype(bool)
            n_trained += int(trained.sum())
            n_trained_unk += int((is_unk & trained).sum())
            if first_unk is None and is_unk.any():
                first_unk = i
        if int(tok["loss_mask"][1:seq_len + 1].sum()) == 0:
            dropped.append(i)
            continue
        truncated += len(tok["tokens"]) - 1 > seq_len
        kept.append(ex)
    n = len(examples)
    if n_unk:
        msg = (f"{source}: {n_unk} of {n_tok} tokens ({n_unk / n_tok:.1%}) are the "
               f"tokenizer's unknown token (characters it cannot represent), first at "
               f"{where(first_unk)}; {n_trained_unk} of {n_trained} trained tokens")
        if n_trained_unk * 2 > n_trained:
            raise ValueError(msg + ": most of what the model would learn is <unk>; use a "
                                   "tokenizer that covers this text")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    if not kept:
        raise ValueError(f"{source}: nothing to train on: none of its {n} examples has a "
                         f"response token within data.seq_len={seq_len} tokens (e.g. "
                         f"{where(dropped[0])}); raise data.seq_len or shorten the prompts")
    if dropped or truncated:
        warnings.warn(f"{source}: {len(dropped)} of {n} examples dropped (no response token "
                      f"within data.seq_len={seq_len}"
                      + (f", first {where(dropped[0])}" if dropped else "")
                      + f"); {truncated} truncated to {seq_len} tokens", RuntimeWarning,
                      stacklevel=2)
    if len(kept) < batch_size and not packing:
        raise ValueError(f"{source}: {len(kept)} trainable examples (of {n}; {len(dropped)} "
                         f"dropped for length) are fewer than data.batch_size={batch_size}")
    return kept


def pad_example(ex: Mapping[str, np.ndarray], seq_len: int) -> dict:
    """Truncate/pad one tokenized example to ``seq_len + 1`` tokens and shift it."""
    tokens, mask = ex["tokens"][:seq_len + 1], ex["loss_mask"][:seq_len + 1]
    n = len(tokens)
    pad = seq_len + 1 - n
    tokens = np.pad(tokens, (0, pad))
    mask = np.pad(mask, (0, pad))
    seg = np.pad(np.ones(n, np.int32), (0, pad))
    return {
        "inputs": tokens[:-1].astype(np.int32),
        "targets": tokens[1:].astype(np.int32),
        "mask": mask[1:].astype(np.int32),
        "segment_ids": seg[:-1].astype(np.int32),
        "positions": np.arange(seq_len, dtype=np.int32),
    }


def _shift_for_packing(ex: Mapping[str, np.ndarray]) -> dict:
    t, m = ex["tokens"], ex["loss_mask"]
    return {"inputs": t[:-1], "targets": t[1:], "mask": m[1:]}


def make_sft_dataset(examples: Sequence[Mapping[str, Any]] | grain.MapDataset, tokenizer, *,
                     seq_len: int, batch_size: int, seed: int = 0, packing: bool = False,
                     num_epochs: int | None = None, drop_remainder: bool = True
                     ) -> grain.IterDataset:
    """A deterministic, checkpointable batch pipeline over `examples`.

    Shuffled with `seed` (reshuffled each epoch), repeated `num_epochs` times (None: forever),
    tokenized, then padded to `seq_len` or packed first-fit into rows of `seq_len`.
    Use ``iter(ds)``; the iterator has ``get_state`` / ``set_state`` (and is saved by
    :mod:`opd_jax.checkpoint`).
    """
    ds = examples if isinstance(examples, grain.MapDataset) else grain.MapDataset.source(
        list(examples))
    if len(ds) < batch_size and not packing:
        raise ValueError(f"batch_size {batch_size} is larger than the data "
                         f"({len(ds)} examples)")
    ds = ds.shuffle(seed=seed).repeat(num_epochs).map(
        lambda ex: tokenize_example(ex, tokenizer))
    if not packing:
        return ds.map(lambda ex: pad_example(ex, seq_len)).batch(
            batch_size, drop_remainder=drop_remainder).to_iter_dataset()
    packed = grain.experimental.FirstFitPackIterDataset(
        ds.map(_shift_for_packing).to_iter_dataset(),
        length_struct={"inputs": seq_len, "targets": seq_len, "mask": seq_len},
        num_packing_bins=max(2, batch_size), seed=seed, shuffle_bins=False)
    return packed.map(_rename_packed).batch(batch_size, drop_remainder=drop_remainder)


def _rename_packed(ex: Mapping[str, np.ndarray]) -> dict:
    return {
        "inputs": ex["inputs"].astype(np.int32),
        "targets": ex["targets"].astype(np.int32),
        "mask": ex["mask"].astype(np.int32),
        "segment_ids": ex["inputs_segment_ids"].astype(np.int32),
        "positions": ex["inputs_positions"].astype(np.int32),
    }


def batches(ds: Iterable[dict], n: int) -> list[dict]:
    """The first `n` batches of `ds` (for tests and notebooks)."""
    it = iter(ds)
    return [next(it) for _ in range(n)]
