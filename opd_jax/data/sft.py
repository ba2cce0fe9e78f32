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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grain
import numpy as np


def tokenize_example(example: Mapping[str, Any], tokenizer, *, add_bos: bool = True) -> dict:
    """Tokenize one example into ``{"tokens", "loss_mask"}`` (see module docstring)."""
    if "messages" in example:
        return _tokenize_chat(example["messages"], tokenizer)
    if "prompt" not in example or "response" not in example:
        raise ValueError(f"example needs 'prompt' and 'response' or 'messages'; got keys "
                         f"{sorted(example)}")
    ids: list[int] = []
    mask: list[int] = []
    if add_bos and tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
        mask.append(0)
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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file of examples; errors name the file and line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"JSONL data file {str(path)!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
    if not out:
        raise ValueError(f"JSONL data file {str(path)!r} holds no examples")
    return out


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
