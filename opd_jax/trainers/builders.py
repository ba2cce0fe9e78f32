"""Build tokenizers, models and datasets from config sections (shared by every trainer),
and the checks every trainer runs on its config before any work (`check_config`)."""
from __future__ import annotations

import warnings

import ml_collections
from flax import nnx
from jax.sharding import Mesh

from opd_jax import envs
from opd_jax import sharding as sh
from opd_jax.data.corpus import demo_example, pretraining_corpus
from opd_jax.data.sft import make_sft_dataset, read_jsonl, scan_examples
from opd_jax.data.synthetic import synthetic_examples
from opd_jax.models import (ModelConfig, ModelRef, Transformer, build_tokenizer,
                            check_tokenizer, check_tokenizer_fits, load_pretrained,
                            resolve_tokenizer)
from opd_jax.schema import ConfigError
from opd_jax.trainers import config_schema
from opd_jax.trainers.config_schema import ARCHITECTURE_KEYS
from opd_jax.trainers.judge import check_judge
from opd_jax.trainers.memory import check_memory


def model_config_from(m: ml_collections.ConfigDict):
    """ModelConfig from a config section (``init_from`` is not a model field)."""
    fields = {k: v for k, v in m.to_dict().items() if k != "init_from"}
    return ModelConfig.from_dict(fields)


def policy_rows(cfg: ml_collections.ConfigDict, n_batch_devices: int) -> int:
    """Rollout rows per iteration (prompts x group size), checked to split into
    ``rl.minibatches`` optimizer steps whose rows divide over the batch devices."""
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    mb = cfg.rl.minibatches
    if rows % mb or (rows // mb) % n_batch_devices:
        raise ValueError(f"prompts_per_step x group_size = {rows} rows in rl.minibatches={mb} "
                         f"must split evenly over {n_batch_devices} batch devices; expected a "
                         f"multiple of {mb * n_batch_devices}")
    buffer = cfg.rl.get("overlong_buffer", 0)
    if buffer and not 0 < buffer <= (longest := overlong_max_len(cfg)):
        raise ValueError(f"rl.overlong_buffer={buffer}: expected 0 (off) to {longest}, the "
                         f"most tokens an episode samples (rollout.sampling.max_new_tokens x "
                         f"max_turns)")
    return rows


def overlong_max_len(cfg: ml_collections.ConfigDict) -> int:
    """DAPO's L_max for a policy run: the most tokens one episode may sample."""
    return cfg.rollout.sampling.max_new_tokens * cfg.rollout.sampling.max_turns


def setup(cfg: ml_collections.ConfigDict):
    """(mesh, rules, tokenizer, model_config) of a run, checked without touching weights
    (every value against the schema first)."""
    config_schema.validate(cfg)
    mesh = sh.make_mesh(tuple(cfg.mesh.shape))
    rules = tuple(tuple(r) for r in cfg.mesh.rules)
    spec = tokenizer_spec(cfg)
    tokenizer = build_tokenizer(spec)
    model_config = planned_model_config(cfg.model)
    check_config(cfg, model_config)
    check_memory(cfg, model_config, sh.batch_shards(mesh, rules))   # before any compile
    check_tokenizer_fits(tokenizer, model_config)
    envs.check_chat_template(tokenizer, run_families(cfg))
    if cfg.model.init_from:
        check_tokenizer(ModelRef(cfg.model.init_from), tokenizer, spec,
                        what="model.init_from")
    if "rewards" in cfg:    # policy runs: the generative reward model, configs only
        check_judge(cfg.rewards.judge, vocab_size=model_config.vocab_size, tokenizer=tokenizer,
                    tokenizer_spec=spec)
    return mesh, rules, tokenizer, model_config


def run_families(cfg: ml_collections.ConfigDict) -> list[str]:
    """The task families a run draws prompts from (policy runs; SFT on task demos)."""
    if "tasks" in cfg:
        return list(dict(cfg.tasks.families).values())
    if cfg.get("data") is not None and cfg.data.get("source") == "tasks":
        return list(dict(cfg.data.tasks.families).values())
    return []


def tokenizer_spec(cfg: ml_collections.ConfigDict) -> str:
    """The run's tokenizer: ``cfg.tokenizer``, or ("") the one its init_from brings."""
    return resolve_tokenizer(cfg.tokenizer, cfg.model.init_from)


def _need(cond: bool, key: str, value, expected: str) -> None:
    if not cond:
        raise ValueError(f"{key}={value!r}: expected {expected}")


def check_config(cfg: ml_collections.ConfigDict, model_config) -> None:
    """What relates several values of a trainer config (SFT, GRPO and OPD), checked before
    anything is built and after each value's own type and range (`schema.validate`, in
    `setup`): sequence lengths against the model's positions, a batch that divides into
    accumulation steps; a warning when RL samples greedily."""
    max_pos = model_config.max_position_embeddings
    if "data" in cfg:       # SFT
        d = cfg.data
        check_positions(d.seq_len, model_config, "data.seq_len")
        _need(d.batch_size % cfg.optim.grad_accum == 0, "data.batch_size", d.batch_size,
              f"a multiple of optim.grad_accum={cfg.optim.grad_accum}")
    if "rollout" in cfg:    # GRPO / OPD
        r = cfg.rollout
        if r.seq_len:
            check_positions(r.seq_len, model_config, "rollout.seq_len")
        for name, sp in (("rollout.sampling", r.sampling), ("eval.sampling", cfg.eval.sampling)):
            _need(sp.max_new_tokens < max_pos, f"{name}.max_new_tokens", sp.max_new_tokens,
                  f"fewer than model.max_position_embeddings={max_pos}")
        if r.sampling.temperature == 0:
            warnings.warn("rollout.sampling.temperature=0: RL samples greedily, so the "
                          "sampler's log-probs are 0 and IcePop/TIS mask (nearly) every token "
                          "and the gradient vanishes; use a temperature > 0", RuntimeWarning,
                          stacklevel=3)


def check_positions(length: int, model_config, what: str) -> None:
    """Raise unless `length` tokens fit the model's ``max_position_embeddings``."""
    max_pos = model_config.max_position_embeddings
    if length > max_pos:
        raise ValueError(f"{what}={length} tokens exceed the model's "
                         f"max_position_embeddings={max_pos}; expected at most {max_pos}")


def _remat(m: ml_collections.ConfigDict) -> str:
    return m.get("remat", "none")     # config files written before the option existed


def planned_model_config(m: ml_collections.ConfigDict):
    """The config of the model `build_model` will return, read without any weights.

    With ``init_from`` the architecture (and an opd_jax checkpoint's param dtype) is the
    checkpoint's; the compute dtype and ``remat`` are always the section's."""
    if m.init_from:
        spec = ModelRef(m.init_from)
        check_init_from_shape(m, spec.model_config())
        config = spec.model_config().replace(dtype=m.dtype, remat=_remat(m))
        # HF weights are cast to param_dtype on load; opd_jax runs keep their own.
        return config.replace(param_dtype=m.param_dtype) if spec.kind != "orbax" else config
    return model_config_from(m)


def check_init_from_shape(m: ml_collections.ConfigDict, config) -> None:
    """Refuse an architecture value `init_from` would ignore: a ``model.`` key set away from
    its schema default to something other than the checkpoint's own value (the checkpoint's
    architecture is what gets built; a silently ignored hidden_size trained another model
    than the config says)."""
    defaults = config_schema.SECTIONS["model"]
    for key in ARCHITECTURE_KEYS:
        if key in m and m[key] != defaults[key].default and m[key] != getattr(config, key):
            raise ConfigError(
                f"model.{key}={m[key]!r} would be ignored: model.init_from={m.init_from!r} "
                f"brings its own architecture ({key}={getattr(config, key)!r}); expected "
                f"{getattr(config, key)!r} or no override")


def build_model(m: ml_collections.ConfigDict, mesh: Mesh, rules, *, seed: int) -> nnx.Module:
    """Random init straight into shardings, or load ``m.init_from`` (an HF folder)."""
    if m.init_from:
        spec = ModelRef(m.init_from, dtype=m.dtype, remat=_remat(m))
        if spec.kind != "orbax":      # an HF folder or a GGUF file
            return load_pretrained(spec.path, dtype=m.dtype, param_dtype=m.param_dtype,
                                   mesh=mesh, rules=rules, remat=_remat(m))
        return sh.shard_model(spec.load(), mesh, rules)
    config = model_config_from(m)
    return sh.init_sharded(lambda: Transformer(config, rngs=nnx.Rngs(seed)), mesh, rules)


def build_sft_dataset(d: ml_collections.ConfigDict, tokenizer):
    if d.source == "synthetic":
        examples = synthetic_examples(d.task, num_examples=d.num_examples, seed=d.seed,
                                      max_digits=d.max_digits)
    elif d.source == "tasks":
        examples = task_demo_examples(d.tasks)
    elif d.source == "corpus":
        examples = pretraining_corpus(per_cell=d.corpus.per_cell,
                                      testbed_per_cell=d.corpus.testbed_per_cell, seed=d.seed,
                                      dose=d.corpus.get("dose", {}).to_dict()
                                      if d.corpus.get("dose") else None)
    elif d.source == "jsonl":
        if not d.path:
            raise ValueError("data.source='jsonl' needs --config.data.path=FILE.jsonl")
        # Every record checked (file:line) and tokenized once; untrainable ones dropped.
        records, lines = read_jsonl(d.path, with_lines=True)
        examples = scan_examples(records, tokenizer, seq_len=d.seq_len, source=d.path,
                                 lines=lines, packing=d.packing, batch_size=d.batch_size)
    else:
        raise ValueError(f"data.source {d.source!r}: expected 'synthetic', 'tasks', 'corpus' "
                         f"or 'jsonl'")
    return make_sft_dataset(examples, tokenizer, seq_len=d.seq_len, batch_size=d.batch_size,
                            seed=d.seed, packing=d.packing)


def task_cells(t: ml_collections.ConfigDict) -> list[tuple[str, str, str]]:
    """(domain, family, effort) cells of a tasks section (policy runs' `tasks`, SFT's
    `data.tasks`): families x efforts, or only `t.cells` ("domain/effort" names)."""
    for d, fam in t.families.items():
        envs.check_family_domain(fam, d)
    grid = [(d, fam, e) for d, fam in t.families.items() for e in t.efforts]
    only = tuple(t.get("cells", ()) or ())
    if not only:
        return grid
    names = {envs.cell_name(d, e): (d, fam, e) for d, fam, e in grid}
    unknown = [c for c in only if c not in names]
    if unknown:
        raise ValueError(f"tasks.cells {unknown} are not in the families x efforts grid "
                         f"{sorted(names)}")
    return [names[c] for c in only]


def train_source(t: ml_collections.ConfigDict) -> envs.MixtureSource:
    """The train-split tasks of a tasks section's cells (`task_cells`), mixed."""
    return envs.MixtureSource([envs.TaskSource(fam, size=t.size, seed=t.seed, effort=e,
                                               difficulty=t.difficulty, split="train")
                               for _, fam, e in task_cells(t)])


def task_demo_examples(t: ml_collections.ConfigDict) -> list[dict]:
    """SFT cold-start data: each train-split task's student prompt and its family's demo
    (`data.corpus.demo_example`: tool observations kept in context, not trained), over the
    families x efforts grid or only its `t.cells` (as the policy trainers read them)."""
    out = [ex for ex in map(demo_example, train_source(t)) if ex is not None]
    if not out:
        raise ValueError(f"no task with a demo in {dict(t.families)}")
    return out
