"""Minimal safetensors reader (memory-mapped, bf16-capable) and writer, no torch.

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then raw little-endian bytes. `safetensors.numpy` cannot return bf16, so
we map the bytes ourselves with numpy + ml_dtypes; slicing a view reads only its pages.

    ckpt = SafetensorsFolder("path/to/hf_model")
    w = ckpt["model.embed_tokens.weight"][100:200]    # reads 100 rows
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _read_file(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    if not header:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {path} has dtype {info['dtype']}; "
                             f"expected one of {sorted(_DTYPES)}")
        start, end = info["data_offsets"]
        raw = mm[8 + n + start: 8 + n + end]
        out[name] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


class SafetensorsFolder(Mapping):
    """name -> memory-mapped np.ndarray over model.safetensors or a sharded index."""

    def __init__(self, folder: str):
        self.folder = os.fspath(folder)
        index = os.path.join(self.folder, INDEX)
        single = os.path.join(self.folder, SINGLE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            files = [SINGLE]
        else:
            raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {self.folder}")
        self._tensors: dict[str, np.ndarray] = {}
        for file in files:
            self._tensors.update(_read_file(os.path.join(self.folder, file)))

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _write_file(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; cannot write to safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def write_folder(folder: str, tensors: Mapping[str, np.ndarray],
                 max_shard_bytes: int | None = None) -> list[str]:
    """Write one model.safetensors, or shards + index when they exceed max_shard_bytes."""
    total = sum(int(np.asarray(a).nbytes) for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        _write_file(os.path.join(folder, SINGLE), tensors)
        return [SINGLE]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        _write_file(os.path.join(folder, file), shard)
        weight_map.update({name: file for name in shard})
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files
