"""A reference to a model checkpoint, shared by students (``model.init_from``), teachers,
judges and evaluation: where it lives, its config and tokenizer identity read without its
weights, and how to load it.

    ref = ModelRef("runs/general_max")        # an opd_jax run, an HF folder, builtin:NAME
    ref.kind                                   # "hf" | "orbax"
    ref.model_config()                         # ModelConfig, no weights read
    ref.tokenizer_identity()                   # (spec, fingerprint) or None
    model = ref.load(mesh=mesh)                # a Transformer, sharded on `mesh` if given

Placement. Without a mesh the model is loaded whole onto the default device. Given a mesh
(and sharding `rules`), it is read straight into the NamedShardings its parameters'
logical axes map to (:func:`opd_jax.sharding.state_shardings`): an HF folder through
``load_pretrained(mesh=)`` (each device reads its block of the memory-mapped safetensors),
an opd_jax run through Orbax restoring each device's shards.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
from flax import nnx

from opd_jax import checkpoint as ckpt_lib
from opd_jax import sharding as sh
from opd_jax.models.builtin import resolve_model_path
from opd_jax.models.config import ModelConfig
from opd_jax.models.gguf_io import gguf_hf_config, is_gguf
from opd_jax.models.hf import config_from_hf, load_pretrained, read_config
from opd_jax.models.identity import read_identity
from opd_jax.models.tokenizers import build_tokenizer, load_tokenizer, tokenizer_fingerprint
from opd_jax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """Where a model lives. `path`: an HF folder, a GGUF file, an opd_jax workdir, a step
    folder, or a shipped or installed model ("builtin:base", "builtin:smollm2")."""
    path: str
    dtype: str | None = None          # compute dtype override (e.g. "bfloat16")
    remat: str | None = None          # ModelConfig.remat override (a student's init_from)

    def __post_init__(self):  # "builtin:base" names a model shipped in the package
        object.__setattr__(self, "path", resolve_model_path(self.path))

    @property
    def kind(self) -> str:
        if is_gguf(self.path):
            return "gguf"
        if os.path.isfile(os.path.join(self.path, "config.json")):
            if any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json")
                   for f in os.listdir(self.path)):
                return "hf"
            run_files = ("checkpoints", "run.lock", "metrics.jsonl")   # an opd_jax workdir
            if not any(os.path.exists(os.path.join(self.path, f)) for f in run_files):
                raise FileNotFoundError(
                    f"{self.path} holds a config.json but no *.safetensors weights; expected "
                    f"a Hugging Face folder with its weights (model.safetensors)")
        return "orbax"

    def model_config(self) -> ModelConfig:
        """The checkpoint's config, read without touching its weights."""
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"checkpoint {self.path!r} does not exist")
        if self.kind == "gguf":
            return config_from_hf(gguf_hf_config(self.path))
        if self.kind == "hf":
            return read_config(self.path)
        meta = ckpt_lib.read_step_meta(ckpt_lib.latest_step_dir(self.path))
        if "model" not in meta:
            raise ValueError(f"checkpoint {self.path!r} has no model config in its metadata")
        return ModelConfig.from_dict(meta["model"])

    def tokenizer_identity(self) -> tuple[str, str] | None:
        """(description, fingerprint) of the tokenizer this checkpoint was trained with, or
        None when it records none (an HF folder without identity.json or tokenizer files)."""
        if self.kind == "gguf":
            return self.path, tokenizer_fingerprint(load_tokenizer(self.path))
        if self.kind == "hf":
            recorded = (read_identity(self.path) or {}).get("tokenizer")
            if recorded:          # identity.json: the tokenizer it was trained with
                return recorded["spec"], recorded["fingerprint"]
            if not _has_tokenizer_files(self.path):
                return None
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
        return spec, tokenizer_fingerprint(build_tokenizer(spec))

    def tokenizer_spec(self) -> str | None:
        """The tokenizer this checkpoint brings, as a run's ``tokenizer`` value: its own
        file or folder (a GGUF file; an HF folder with tokenizer files), the spec an opd_jax
        run recorded, the one an HF folder's identity.json records ("synthetic" for the shipped
        base); None when it names none."""
        if self.kind == "gguf":
            return self.path
        if self.kind == "hf":
            if _has_tokenizer_files(self.path):
                return self.path
            recorded = (read_identity(self.path) or {}).get("tokenizer")
            return recorded["spec"] if recorded else None
        ident = self.tokenizer_identity()
        return None if ident is None else ident[0]

    def load(self, mesh: jax.sharding.Mesh | None = None,
             rules: sh.Rules = sh.DEFAULT_RULES) -> Transformer:
        """The model, on the default device (`mesh` None) or read straight into the
        NamedShardings of `mesh` by the logical-axis `rules` (multi-process: every process
        calls this, each reads only its shards)."""
        if self.kind in ("hf", "gguf"):
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


def _has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f))
               for f in ("tokenizer.json", "tokenizer_config.json"))


def check_tokenizer(ref: ModelRef, tokenizer, tokenizer_spec: str, *, what: str) -> None:
    """Raise unless `ref`'s recorded tokenizer is `tokenizer` (nothing recorded: accepted)."""
    ident = ref.tokenizer_identity()
    if ident is None:
        return
    theirs, fp = ident
    ours = tokenizer_fingerprint(tokenizer)
    if fp != ours:
        raise ValueError(f"{what} {ref.path!r} was trained with tokenizer {theirs!r} "
                         f"(fingerprint {fp}), but this run uses tokenizer {tokenizer_spec!r} "
                         f"(fingerprint {ours}); their vocabularies differ, so token ids "
                         f"would not mean the same text. Use the same tokenizer")


def model_bytes(model: nnx.Module) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


def resolve_tokenizer(spec: str, init_from: str = "") -> str:
    """A run's tokenizer value: `spec` when the config names one, else the tokenizer its
    `init_from` checkpoint brings (``builtin:smollm2`` its own BPE, an opd_jax run the one
    it recorded, the shipped base "synthetic"); a clear error when neither names one."""
    if spec:
        return spec
    if not init_from:
        raise ValueError("tokenizer='' takes the tokenizer from model.init_from, but "
                         "model.init_from is empty; expected a tokenizer ('synthetic' or a "
                         "local folder) or a checkpoint to start from")
    ref = ModelRef(init_from)
    own = ref.tokenizer_spec()
    if own is None:
        raise ValueError(f"tokenizer='' takes the tokenizer from model.init_from="
                         f"{init_from!r}, which records none; expected a tokenizer in the "
                         f"config ('synthetic' or a local folder)")
    return init_from if own == ref.path else own
