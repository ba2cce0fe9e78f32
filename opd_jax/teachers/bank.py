"""The teacher bank: a registry of teacher checkpoints, loaded on demand into a bounded cache.

A key (any string; the recipes use ``"domain/effort"``) maps to a :class:`TeacherSpec`: a
Hugging Face folder (config.json + safetensors) or an opd_jax run (its Orbax checkpoints).
Teachers may differ from the student in size but must share its vocabulary and tokenizer,
which :meth:`TeacherBank.validate` checks from the configs alone, before any weights are
read: the vocabulary size, and the tokenizer identity (`tokenizer_fingerprint`, recorded in
every opd_jax checkpoint's meta, or read from an HF folder's tokenizer files).
Loaded teachers live in an LRU cache bounded by count and/or bytes; loads and evictions are
logged and counted (``bank.stats``).

Placement. Without a mesh a teacher is loaded whole onto the default device (one process's
first device), as before. Given the run's `mesh` (and sharding `rules`), every teacher is
read straight into the NamedShardings its parameters' logical axes map to, like the
student (:func:`opd_jax.sharding.state_shardings`): an HF folder through
``load_pretrained(mesh=)`` (each device reads its block of the memory-mapped safetensors),
an opd_jax run through Orbax restoring each device's shards. No device then holds a whole
teacher (unless the rules replicate it), and a mesh spanning several processes gives
global arrays.

    bank = TeacherBank({"general/max": TeacherSpec("runs/general_max")}, max_loaded=2,
                       mesh=mesh)
    bank.validate(student_vocab=128)
    teacher = bank.get("general/max")          # a Transformer, loaded if needed
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping

import jax
from flax import nnx

from opd_jax import checkpoint as ckpt_lib
from opd_jax import sharding as sh
from opd_jax.models import ModelConfig, Transformer, load_pretrained

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
    """Where a teacher lives. `path`: an HF folder, an opd_jax workdir, a step folder, or
    a shipped model ("builtin:base")."""
    path: str
    dtype: str | None = None          # compute dtype override (e.g. "bfloat16")
    remat: str | None = None          # ModelConfig.remat override (a student's init_from)

    def __post_init__(self):  # "builtin:base" names a model shipped in the package
        from opd_jax.models.builtin import resolve_model_path
        object.__setattr__(self, "path", resolve_model_path(self.path))

    @property
    def kind(self) -> str:
        return "hf" if os.path.isfile(os.path.join(self.path, "config.json")) and any(
            f.endswith(".safetensors") or f.endswith(".safetensors.index.json")
            for f in os.listdir(self.path)) else "orbax"

    def model_config(self) -> ModelConfig:
        """The teacher's config, read without touching its weights."""
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"teacher checkpoint {self.path!r} does not exist")
        if self.kind == "hf":
            from opd_jax.models import config_from_hf
            with open(os.path.join(self.path, "config.json"), encoding="utf-8") as f:
                return config_from_hf(json.load(f))
        meta = ckpt_lib.read_step_meta(ckpt_lib.latest_step_dir(self.path))
        if "model" not in meta:
            raise ValueError(f"checkpoint {self.path!r} has no model config in its metadata")
        return ModelConfig.from_dict(meta["model"])

    def tokenizer_identity(self) -> tuple[str, str] | None:
        """(description, fingerprint) of the tokenizer this checkpoint was trained with, or
        None when it records none (an HF folder without tokenizer files)."""
        if self.kind == "hf":
            if not any(os.path.isfile(os.path.join(self.path, f))
                       for f in ("tokenizer.json", "tokenizer_config.json")):
                return None
            from opd_jax.models import load_tokenizer
            return self.path, tokenizer_fingerprint(load_tokenizer(self.path))
        step_dir = ckpt_lib.latest_step_dir(self.path)
        recorded = ckpt_lib.read_step_meta(step_dir).get("tokenizer")
        if recorded:
            return recorded["spec"], recorded["fingerprint"]
        # Checkpoints written before the fingerprint: the run's config.json names it.
        run_config = os.path.join(os.path.dirname(os.path.dirname(step_dir)), "config.json")
        if not os.path.isfile(run_config):
            return None
        with open(run_config, encoding="utf-8") as f:
            spec = json.load(f).get("tokenizer")
        if spec != "synthetic" and not (isinstance(spec, str) and os.path.isdir(spec)):
            return None
        from opd_jax.trainers.builders import build_tokenizer
        return spec, tokenizer_fingerprint(build_tokenizer(spec))

    def load(self, mesh: jax.sharding.Mesh | None = None,
             rules: sh.Rules = sh.DEFAULT_RULES) -> Transformer:
        """The model, on the default device (`mesh` None) or read straight into the
        NamedShardings of `mesh` by the logical-axis `rules` (multi-process: every process
        calls this, each reads only its shards)."""
        if self.kind == "hf":
            return load_pretrained(self.path, dtype=self.dtype, remat=self.remat, mesh=mesh,
                                   rules=rules)
        config = self.model_config()
        if self.dtype:
            config = config.replace(dtype=self.dtype)
        if self.remat:
            config = config.replace(remat=self.remat)
        abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        shardings = None if mesh is None else sh.state_shardings(params, mesh, rules)
        params = ckpt_lib.restore_params(ckpt_lib.latest_step_dir(self.path), params,
                                         shardings)
        return nnx.merge(graphdef, params, rest)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's identity: its whole vocabulary (token -> id) and its
    special tokens. Two tokenizers of the same size but other tokens differ."""
    vocab = sorted((int(i), t) for t, i in tokenizer.get_vocab().items())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def check_tokenizer(spec: TeacherSpec, tokenizer, tokenizer_spec: str, *, what: str) -> None:
    """Raise unless `spec`'s recorded tokenizer is `tokenizer` (nothing recorded: accepted)."""
    ident = spec.tokenizer_identity()
    if ident is None:
        return
    theirs, fp = ident
    ours = tokenizer_fingerprint(tokenizer)
    if fp != ours:
        raise ValueError(f"{what} {spec.path!r} was trained with tokenizer {theirs!r} "
                         f"(fingerprint {fp}), but this run uses tokenizer {tokenizer_spec!r} "
                         f"(fingerprint {ours}); their vocabularies differ, so token ids "
                         f"would not mean the same text. Use the same tokenizer")


def model_bytes(model: nnx.Module) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


class TeacherBank:
    """Registry + LRU cache of teachers. ``max_loaded`` / ``max_bytes`` bound the cache;
    ``mesh`` / ``rules`` place every loaded teacher on the mesh (see the module docstring),
    None loads each on the default device."""

    def __init__(self, specs: Mapping[str, TeacherSpec | str], *, max_loaded: int | None = None,
                 max_bytes: int | None = None, mesh: jax.sharding.Mesh | None = None,
                 rules: sh.Rules = sh.DEFAULT_RULES):
        if not specs:
            raise ValueError("the teacher bank is empty; give at least one teacher")
        self.specs = {k: v if isinstance(v, TeacherSpec) else TeacherSpec(str(v))
                      for k, v in specs.items()}
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.max_loaded, self.max_bytes = max_loaded, max_bytes
        self.mesh, self.rules = mesh, tuple(rules)
        self._cache: collections.OrderedDict[str, tuple[Transformer, int]] = collections.OrderedDict()
        self.stats = {"loads": 0, "evictions": 0, "hits": 0}
        self.events: list[tuple[str, str]] = []   # ("load" | "evict", key), in order

    def keys(self) -> list[str]:
        return list(self.specs)

    def validate(self, student_vocab: int, tokenizer=None, tokenizer_spec: str = "?"
                 ) -> dict[str, ModelConfig]:
        """Every teacher exists and shares the student's vocabulary (configs only) and, given
        the student's `tokenizer` (`tokenizer_spec`: its config value), its tokenizer."""
        configs = {}
        for key, spec in self.specs.items():
            cfg = spec.model_config()
            if cfg.vocab_size != student_vocab:
                raise ValueError(f"teacher vocab {cfg.vocab_size} != student vocab "
                                 f"{student_vocab} (teacher {key!r} at {spec.path})")
            if tokenizer is not None:
                check_tokenizer(spec, tokenizer, tokenizer_spec, what=f"teacher {key!r} at")
            configs[key] = cfg
        return configs

    def spec(self, key: str) -> TeacherSpec:
        if key not in self.specs:
            raise KeyError(f"no teacher for {key!r}; the bank has: {', '.join(sorted(self.specs))}")
        return self.specs[key]

    def get(self, key: str) -> Transformer:
        spec = self.spec(key)
        if key in self._cache:
            self._cache.move_to_end(key)
            self.stats["hits"] += 1
            return self._cache[key][0]
        model = spec.load(self.mesh, self.rules)
        size = model_bytes(model)
        self._cache[key] = (model, size)
        self.stats["loads"] += 1
        self.events.append(("load", key))
        log.info("teacher %s loaded from %s (%.1f MB)", key, spec.path, size / 2**20)
        self._evict(keep=key)
        return model

    def loaded(self) -> list[str]:
        return list(self._cache)

    def _evict(self, keep: str) -> None:
        def over():
            n_over = self.max_loaded is not None and len(self._cache) > self.max_loaded
            b_over = self.max_bytes is not None and sum(s for _, s in self._cache.values()) > self.max_bytes
            return n_over or b_over
        while over() and len(self._cache) > 1:
            key = next(k for k in self._cache if k != keep)
            del self._cache[key]
            self.stats["evictions"] += 1
            self.events.append(("evict", key))
            log.info("teacher %s evicted", key)
