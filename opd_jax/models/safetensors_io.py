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
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise ValueError(f"{path}: not a safetensors file (truncated: {size} bytes, "
                             f"header length {n if size >= 8 else '?'})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({e}); "
                             f"the file is corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    if not header:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise ValueError(f"tensor {name!r} in {path}: header entry {info!r:.80} needs "
                             f"dtype, shape and data_offsets")
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {path} has dtype {info['dtype']}; "
                             f"expected one of {sorted(_DTYPES)}")
        start, end = info["data_offsets"]
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(
            _DTYPES[info["dtype"]]).itemsize
        if not 0 <= start <= end <= size - 8 - n or end - start != nbytes:
            raise ValueError(f"tensor {name!r} in {path}: bytes [{start}, {end}) do not hold "
                             f"a {info['dtype']} {info['shape']} tensor ({nbytes} bytes) "
                             f"inside the file's {size - 8 - n} data bytes; the file is "
                             f"truncated or corrupt")
        raw = mm[8 + n + start: 8 + n + end]
        out[name] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


SKIP_FINITE_ENV = "OPD_JAX_SKIP_FINITE_CHECK"


def check_finite(tensors: Mapping[str, np.ndarray], where: str, *,
                 chunk_bytes: int = 64 << 20) -> None:
    """Raise ValueError naming the first floating tensor of `tensors` holding a NaN or inf.

    Reads every tensor once, in chunks (memory-mapped files stay lazy). Skipped when the
    environment variable ``OPD_JAX_SKIP_FINITE_CHECK=1`` is set (for speed)."""
    if os.environ.get(SKIP_FINITE_ENV, "") not in ("", "0"):
        return
    for name, arr in tensors.items():
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
            continue
        flat = arr.reshape(-1)
        step = max(1, chunk_bytes // max(arr.dtype.itemsize, 1))
        for i in range(0, flat.size, step):
            block = np.asarray(flat[i:i + step], np.float32)
            if not np.isfinite(block).all():
                j = i + int(np.argmin(np.isfinite(block)))
                raise ValueError(f"tensor {name!r} in {where} holds a non-finite value "
                                 f"({block[j - i]} at flat index {j}); the weights are "
                                 f"corrupt ({SKIP_FINITE_ENV}=1 skips this check)")


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

    def check_finite(self) -> None:
        """Raise naming the first tensor with a NaN or inf (see `check_finite`)."""
        check_finite(self, self.folder)

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
