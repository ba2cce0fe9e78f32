"""The teacher bank: a registry of teacher checkpoints, loaded on demand into a bounded cache.

A key (any string; the recipes use ``"domain/effort"``) maps to a model reference
(:class:`opd_jax.models.ModelRef`): a Hugging Face folder (config.json + safetensors), an
opd_jax run (its Orbax checkpoints) or a shipped model.
Teachers may differ from the student in size but must share its vocabulary and tokenizer,
which :meth:`TeacherBank.validate` checks from the configs alone, before any weights are
read: the vocabulary size, and the tokenizer identity (`tokenizer_fingerprint`, recorded in
every opd_jax checkpoint's meta, or read from an HF folder's tokenizer files).
Loaded teachers live in an LRU cache bounded by count and/or bytes; loads and evictions are
logged and counted (``bank.stats``).

Placement. Without a mesh a teacher is loaded whole onto the default device. Given the
run's `mesh` (and sharding `rules`), every teacher is read straight into its
NamedShardings, like the student (`ModelRef.load`): no device then holds a whole teacher
(unless the rules replicate it), and a mesh spanning several processes gives global arrays.

    bank = TeacherBank({"general/max": ModelRef("runs/general_max")}, max_loaded=2,
                       mesh=mesh)
    bank.validate(student_vocab=128)
    teacher = bank.get("general/max")          # a Transformer, loaded if needed
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Mapping

import jax

from opd_jax import sharding as sh
from opd_jax.checkpoint import CheckpointError
from opd_jax.models import ModelConfig, ModelRef, Transformer, check_tokenizer, model_bytes
from opd_jax.teachers.served import is_served, parse_spec

log = logging.getLogger(__name__)


class TeacherBank:
    """Registry + LRU cache of teachers. ``max_loaded`` / ``max_bytes`` bound the cache;
    ``mesh`` / ``rules`` place every loaded teacher on the mesh (see the module docstring),
    None loads each on the default device."""

    def __init__(self, specs: Mapping[str, ModelRef | str], *, max_loaded: int | None = None,
                 max_bytes: int | None = None, mesh: jax.sharding.Mesh | None = None,
                 rules: sh.Rules = sh.DEFAULT_RULES):
        if not specs:
            raise ValueError("the teacher bank is empty; give at least one teacher")
        # A served teacher ("vllm+http://...", `teachers.served`) stays a string: the
        # scorer talks to it; the bank neither loads nor caches it.
        self.specs = {k: v if isinstance(v, ModelRef) or is_served(v) else ModelRef(str(v))
                      for k, v in specs.items()}
        for k, v in self.specs.items():
            if isinstance(v, str):
                parse_spec(v)            # a malformed URL fails here, naming it
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded}")
        self.max_loaded, self.max_bytes = max_loaded, max_bytes
        self.mesh, self.rules = mesh, tuple(rules)
        self._cache: collections.OrderedDict[str, tuple[Transformer, int]] = collections.OrderedDict()
        self.stats = {"loads": 0, "evictions": 0, "hits": 0}
        self.events: list[tuple[str, str]] = []   # ("load" | "evict", key), in order

    def keys(self) -> list[str]:
        return list(self.specs)

    def is_served(self, key: str) -> bool:
        return isinstance(self.spec(key), str)

    def validate(self, student_vocab: int, tokenizer=None, tokenizer_spec: str = "?",
                 own_tokenizers: Mapping[str, tuple] | None = None) -> dict[str, ModelConfig]:
        """Every teacher exists and shares the student's vocabulary (configs only) and, given
        the student's `tokenizer` (`tokenizer_spec`: its config value), its tokenizer.
        `own_tokenizers` {key: (tokenizer, spec)}: teachers with another tokenizer
        (`teachers.tokenizers`), checked against that one instead (their vocabulary is
        theirs)."""
        configs = {}
        own_tokenizers = dict(own_tokenizers or {})
        for key, spec in self.specs.items():
            if isinstance(spec, str):   # served: vocabulary checked by its probe
                continue
            if key in own_tokenizers:
                tok, tspec = own_tokenizers[key]
                cfg = spec.model_config()
                check_tokenizer(spec, tok, tspec, what=f"teacher {key!r} at")
                configs[key] = cfg
                continue
            try:
                cfg = spec.model_config()
            except FileNotFoundError as e:
                raise FileNotFoundError(f"teacher {key!r}: {e}") from None
            if cfg.vocab_size != student_vocab:
                raise ValueError(f"teacher vocab {cfg.vocab_size} != student vocab "
                                 f"{student_vocab} (teacher {key!r} at {spec.path})")
            if tokenizer is not None:
                check_tokenizer(spec, tokenizer, tokenizer_spec, what=f"teacher {key!r} at")
            configs[key] = cfg
        return configs

    def open_all(self, keys=None) -> None:
        """Load every teacher (or those of `keys`) once, integrity and finiteness checked by
        its reader, so a corrupt or unreadable checkpoint fails before any rollout, naming
        it; the last `max_loaded` stay cached for the first scoring."""
        for key in (self.specs if keys is None else keys):
            if self.is_served(key):
                continue
            try:
                self.get(key)
            except CheckpointError as e:
                raise CheckpointError(f"teacher {key!r} at {self.specs[key].path}: {e}") from e
            except (OSError, ValueError) as e:
                raise type(e)(f"teacher {key!r} at {self.specs[key].path}: {e}") from e

    def spec(self, key: str) -> ModelRef | str:
        if key not in self.specs:
            raise KeyError(f"no teacher for {key!r}; the bank has: {', '.join(sorted(self.specs))}")
        return self.specs[key]

    def get(self, key: str) -> Transformer:
        spec = self.spec(key)
        if isinstance(spec, str):
            raise ValueError(f"teacher {key!r} is served by {spec}: it has no weights here "
                             f"(the scorer asks the server)")
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
