"""The identity of an HF folder the project writes or ships: ``identity.json`` beside its
weights records the sha256 of every weight, config and tokenizer file and, when known, the
tokenizer it was trained with (``{"spec", "fingerprint"}``, `tokenizers.tokenizer_fingerprint`).

    write_identity("out/", tokenizer={"spec": "synthetic", "fingerprint": "..."})
    verify_identity("out/")       # raises naming the file whose bytes changed
    read_identity("out/")         # the record, or None (a folder from elsewhere)

Written by `save_pretrained` (exports, merges, the shipped base) and `convert_gguf`;
verified by `load_pretrained` before any weight is read, so a shipped or exported model
whose bytes changed (even to finite values: an embedding zeroed) is refused instead of
loading. opd_jax runs (Orbax) carry the same two facts in each checkpoint's meta: the
tokenizer and a checksum per array (`opd_jax.checkpoint`).
"""
from __future__ import annotations

import hashlib
import json
import os

IDENTITY = "identity.json"
_SHA: dict[tuple, str] = {}


def file_sha256(path) -> str:
    """The file's sha256, hashed once per process for an unchanged file (size, mtime)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _SHA[key] = h.hexdigest()
    return _SHA[key]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _content_files(folder: str) -> list[str]:
    """The files that make the model: config, weights and tokenizer files (not a card)."""
    return sorted(f for f in os.listdir(folder)
                  if f == "config.json" or f.endswith(".safetensors")
                  or f.endswith(".safetensors.index.json") or f in TOKENIZER_FILES)


def write_identity(folder, tokenizer: dict | None = None) -> dict:
    """Record the content hash of `folder`'s weights and config, and `tokenizer`."""
    folder = os.fspath(folder)
    record = {"files": {f: file_sha256(os.path.join(folder, f))
                        for f in _content_files(folder)},
              "tokenizer": dict(tokenizer) if tokenizer else None}
    tmp = os.path.join(folder, f".{IDENTITY}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(folder, IDENTITY))
    return record


def read_json(file: str, expected: str):
    """A JSON file's value; one ValueError naming the file and what was `expected`."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}); expected {expected}") from None


def read_identity(folder) -> dict | None:
    file = os.path.join(os.fspath(folder), IDENTITY)
    if not os.path.isfile(file):
        return None
    record = read_json(file, "the identity record opd_jax wrote with the weights")
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise ValueError(f"{file}: expected {{'files': {{name: sha256}}, 'tokenizer': ...}}")
    return record


def verify_identity(folder) -> dict | None:
    """Raise unless every file `folder`'s identity.json records has its recorded sha256;
    the record (None for a folder without one)."""
    folder = os.fspath(folder)
    record = read_identity(folder)
    if record is None:
        return None
    for name, want in record["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing; {folder}/{IDENTITY} records it "
                                    f"(sha256 {want[:16]}...)")
        got = file_sha256(path)
        if got != want:
            raise ValueError(f"{path} has sha256 {got[:16]}..., expected {want[:16]}... as "
                             f"recorded in {IDENTITY} when it was written: its bytes changed "
                             f"since (corrupt or edited); restore or re-export it")
    return record
