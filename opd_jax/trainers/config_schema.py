"""One schema for the trainer configs: every key with its default, type and range or set
(`opd_jax.schema.Field`), declared once, here; the config files (opd_jax/configs/) build
their sections from it.

    section("optim", lr=1e-4)          # a ConfigDict of the defaults, then overrides
    validate(cfg)                      # every value, before any work
    numeric_fields("sft", cfg)         # (key, Field) of every numeric value (the test's walk)

Roots: ``sft`` (configs/sft.py), ``policy`` (configs/grpo.py and opd.py), ``eval_root``
(configs/eval.py); ``merge`` is an experiment's merge stage. ``objective.options`` is
declared by each objective's own dataclass (`schema.option`, trainers/objectives.py) and
the mismatch correction's by `losses.Correction`.

`validate` raises `ConfigError` with one line naming the first bad key, its value and what
was expected, or a key the schema does not declare. It runs first in `builders.setup`
(every trainer), in `evaluate_checkpoint` and, for each stage of an experiment, before the
experiment writes anything (`recipes.pipeline.check_stages`). Checks that relate several
values (positions against ``max_position_embeddings``, a batch that must divide over
devices, the memory estimate) stay beside the code that needs them (`builders`).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import ml_collections

from opd_jax.envs.rewards import DEFAULT_RUBRIC
from opd_jax.losses import Correction
from opd_jax.models.config import ARCHS, DTYPES, REMATS
from opd_jax.schema import (Bool, Choice, ConfigError, Field, Float, Int, Map, Seq, Str, Sub,
                            option_fields)
from opd_jax.sharding import DEFAULT_RULES
from opd_jax.teachers.merge import METHODS
from opd_jax.teachers.routing import ROUTINGS, WEIGHTINGS
from opd_jax.trainers.objectives import OBJECTIVES

# section name -> {key: Field, or a nested section `Sub(name)`}
SECTIONS: dict[str, dict[str, Field | Sub]] = {}

SEED = dict(lo=0, hint="a PRNG seed")

SECTIONS["model"] = dict(
    init_from=Str("", hint="an HF folder, a GGUF file, an opd_jax workdir or builtin:NAME; "
                           "'' = random init"),
    arch=Choice("qwen3", ARCHS),
    vocab_size=Int(128, lo=1),
    hidden_size=Int(128, lo=1),
    intermediate_size=Int(384, lo=1),
    num_layers=Int(2, lo=1),
    num_heads=Int(4, lo=1),
    num_kv_heads=Int(2, lo=1),
    head_dim=Int(32, lo=2),
    rope_theta=Float(10_000.0, lo=0, lo_open=True),
    rms_norm_eps=Float(1e-6, lo=0, lo_open=True),
    tie_embeddings=Bool(True),
    max_position_embeddings=Int(512, lo=1),
    dtype=Choice("float32", DTYPES),
    param_dtype=Choice("float32", DTYPES),
    remat=Choice("none", REMATS, hint="gradient checkpointing per layer"),
)
# The architecture keys: with model.init_from the checkpoint's own are used, so a value
# here that differs from the default is refused (builders.check_init_from_shape).
ARCHITECTURE_KEYS = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps",
                     "tie_embeddings", "max_position_embeddings")

SECTIONS["optim"] = dict(
    name=Choice("adamw", ("adamw", "sgd")),
    lr=Float(3e-3, lo=0, lo_open=True),
    b1=Float(0.9, lo=0, hi=1, hi_open=True),
    b2=Float(0.95, lo=0, hi=1, hi_open=True),
    eps=Float(1e-8, lo=0, lo_open=True),
    weight_decay=Float(0.01, lo=0),
    warmup_steps=Int(20, lo=0),
    schedule=Choice("cosine", ("cosine", "constant")),
    min_lr_ratio=Float(0.1, lo=0, hi=1, hint="the cosine schedule's floor, a fraction of "
                                            "optim.lr"),
    grad_clip=Float(1.0, lo=0, hint="0: no clipping"),
    grad_accum=Int(1, lo=1),
)

SECTIONS["train"] = dict(
    steps=Int(200, lo=1), log_every=Int(10, lo=1), ckpt_every=Int(50, lo=1),
    keep_checkpoints=Int(2, lo=1),
    max_bad_steps=Int(0, lo=0, hint="0: stop at the first non-finite step"),
)

SECTIONS["mesh"] = dict(
    shape=Seq((-1, 1, 1), hint="(data, fsdp, tensor); -1: the rest of the devices"),
    rules=Seq(DEFAULT_RULES, hint="(logical axis, mesh axis) pairs"),
)

SECTIONS["sampling"] = dict(
    max_new_tokens=Int(24, lo=1, hint="nothing would be sampled, so nothing trained"),
    temperature=Float(1.0, lo=0), top_k=Int(0, lo=0, hint="0: off"),
    top_p=Float(1.0, lo=0, hi=1, lo_open=True, hint="1: off"),
    max_turns=Int(3, lo=1), use_think_budget=Bool(True),
)

SECTIONS["eval"] = dict(
    every=Int(10, lo=0, hint="0: only at the end"), n=Int(32, lo=1), seed=Int(0, **SEED),
    batch_size=Int(64, lo=1), sampling=Sub("eval.sampling"),
)
SECTIONS["eval.sampling"] = dict(SECTIONS["sampling"], temperature=Float(0.0, lo=0))

_TASKS = dict(
    families=Map({"general": "arithmetic"}, hint="domain -> task family"),
    efforts=Seq(("high",)), difficulty=Int(1, lo=1, hi=5), size=Int(10_000, lo=1),
    seed=Int(0, **SEED), cells=Seq((), hint="non-empty: only these 'domain/effort' cells"),
)
SECTIONS["tasks"] = _TASKS
SECTIONS["eval_tasks"] = {k: v for k, v in _TASKS.items() if k in ("families", "efforts",
                                                                    "difficulty", "seed")}

SECTIONS["rollout"] = dict(
    prompts_per_step=Int(8, lo=1), group_size=Int(4, lo=1),
    seq_len=Int(0, lo=0, hint="0: bucket per batch"),
    wal_every=Int(32, lo=0, hint="decode steps between commits of the rollout's token log; "
                                 "0: no log"),
    sampling=Sub("sampling"),
)

SECTIONS["rl"] = dict(
    adv_scale=Choice("std", ("std", "none")), dynamic_sampling=Bool(False),
    ppo_epochs=Int(1, lo=1), minibatches=Int(1, lo=1),
    overlong_buffer=Int(0, lo=0, hint="DAPO's soft overlong punishment; 0: off"),
)

SECTIONS["judge"] = dict(
    path=Str("", hint="an HF folder, an opd_jax workdir or builtin:NAME; '' = no judge"),
    rubric=Str(DEFAULT_RUBRIC), weight=Float(0.0, lo=0), max_new_tokens=Int(16, lo=1),
    include_reference=Bool(False), batch_size=Int(64, lo=1),
)
SECTIONS["rewards"] = dict(judge=Sub("judge"))

SECTIONS["teachers"] = dict(
    paths=Map(hint="teacher key -> checkpoint"), routing=Choice("cell", ROUTINGS),
    table=Map(hint="routing='table': cell or domain -> key"),
    weights=Map(hint="routing='mixture': cell or domain -> {key: weight}"),
    max_loaded=Int(0, lo=0, hint="LRU bound on loaded teachers; 0: unbounded"),
    prompt_role=Choice("student", ("student", "teacher")),
    weighting=Choice("static", WEIGHTINGS, hint="confidence: per token, from each teacher's "
                     "entropy (full-vocabulary objective)"),
    confidence_temperature=Float(1.0, lo=0, lo_open=True,
                                 hint="weighting='confidence': w ~ prior exp(-H / tau)"),
    served=Sub("teachers.served"),
    tokenizers=Map(hint="key -> tokenizer spec of a teacher with another tokenizer than the "
                   "student's (sampled-token and top-k signals; docs/teachers.md)"),
)
# Teachers behind a server (a teachers.paths value "vllm+http://...", docs/teachers.md).
SECTIONS["teachers.served"] = dict(
    timeout_s=Float(60.0, lo=0, lo_open=True), retries=Int(3, lo=0),
    batch_rows=Int(8, lo=1, hint="rows per request (vllm, sglang; openai: 1)"),
    max_missing=Float(0.1, lo=0, hi=1, hint="share of sampled tokens without a log-prob "
                      "(top-k-only servers) above which a batch is refused"),
    params=Map(hint="key -> parameter count, for the FLOP count (else 0)"),
)


# objective.name is checked against the registry when validated (objectives registered
# later, by a user or a test, count too).
SECTIONS["objective"] = dict(name=Str("grpo", hint="a registered objective"),
                             options=Sub("objective.options"))
SECTIONS["objective.options"] = {}      # per objective: its dataclass's option fields

SECTIONS["data.tasks"] = dict(_TASKS, efforts=Seq(("low", "high", "max")), size=Int(2000, lo=1))
SECTIONS["data.corpus"] = dict(
    per_cell=Int(300, lo=1), testbed_per_cell=Int(1200, lo=0),
    dose=Map(hint="family -> {difficulty: demos per effort}, instead of the counts above"))
SECTIONS["data"] = dict(
    source=Choice("synthetic", ("synthetic", "tasks", "corpus", "jsonl")),
    path=Str("", hint="the JSONL file of source='jsonl'"),
    task=Str("addition", hint="the built-in synthetic task of source='synthetic'"),
    tasks=Sub("data.tasks"), corpus=Sub("data.corpus"),
    num_examples=Int(2000, lo=1), max_digits=Int(2, lo=1), seq_len=Int(32, lo=1),
    batch_size=Int(32, lo=1), packing=Bool(False), seed=Int(0, **SEED),
)

_COMMON_TOKENIZER = Str("synthetic", hint="'synthetic', a tokenizer folder, or '' for the "
                                          "one model.init_from brings")
_COMMON = dict(seed=Int(0, **SEED), model=Sub("model"), tokenizer=_COMMON_TOKENIZER,
               optim=Sub("optim"), train=Sub("train"), mesh=Sub("mesh"))
# An experiment's own values (opd_jax/recipes, experiments/*/config.py); its trainer
# sections (sft, teacher, student, ...) are checked as the stages built from them.
SECTIONS["experiment_eval"] = dict(SECTIONS["eval"], difficulty=Int(
    None, lo=1, hi=5, optional=True, hint="the testbed level the report evaluates at"))
SECTIONS["experiment"] = dict(
    recipe=Str("kimi_k3"), tokenizer=_COMMON_TOKENIZER,
    seeds=Seq((0,), item=Int(0, **SEED), hint="one run of every stage per seed"),
    domains=Map(hint="domain -> task family"), efforts=Seq(()),
    effort_schedule=Choice("anneal", ("anneal", "plain", "both")),
    eval=Sub("experiment_eval"), merge=Sub("merge"),
    judge_stages=Seq(()), per_turn=Seq(()), stages=Seq(()), stage_teachers=Map(),
    merge_scales=Seq((1.0,), item=Float(1.0, lo=0, lo_open=True)),
    student_from_merge=Float(None, lo=0, lo_open=True, optional=True,
                             hint="kimi_k3: the student starts from the merge of this scale "
                                  "(one of merge_scales); None: from the start"),
    general_max_new=Int(64, lo=1), start=Str(""), val_n=Int(64, lo=1),
    mixed_rl_steps=Int(0, lo=0, hint="kimi_k3: the mixed-data baseline's GRPO iterations on "
                                     "every cell after its SFT on every domain; 0: no "
                                     "mixed-data baseline"),
)
SECTIONS["sft"] = dict(_COMMON, data=Sub("data"))
SECTIONS["policy"] = dict(_COMMON, tasks=Sub("tasks"), rollout=Sub("rollout"),
                          eval=Sub("eval"), rl=Sub("rl"), rewards=Sub("rewards"),
                          teachers=Sub("teachers"), objective=Sub("objective"))
SECTIONS["eval_root"] = dict(tokenizer=_COMMON["tokenizer"], tasks=Sub("eval_tasks"),
                             eval=Sub("eval"))

# An experiment's merge stage (opd_jax/recipes/pipeline.py, Stage kind "merge").
SECTIONS["merge"] = dict(
    method=Choice("task_arithmetic", METHODS),
    scale=Float(1.0, lo=0, lo_open=True, hint="task arithmetic's lambda"),
    weights=Map(hint="model key -> weight, summing to 1; empty: equal"),
    base=Str("", hint="task arithmetic's base when it is no stage: a checkpoint or builtin:NAME"),
)


# -- building and validating ---------------------------------------------------------------


def section(name: str, **overrides) -> ml_collections.ConfigDict:
    """A ConfigDict of section `name`'s defaults (nested sections built too), then
    `overrides` (checked against the section's keys)."""
    fields = _section(name)
    out = ml_collections.ConfigDict()
    for key, f in fields.items():
        out[key] = section(f.name) if isinstance(f, Sub) else _copy(f.default)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"section {name!r} has no key(s) {unknown}; known keys: "
                          f"{', '.join(sorted(fields))}")
    out.update(overrides)
    return out


def _copy(v):
    return dict(v) if isinstance(v, dict) else v


def _section(name: str) -> dict:
    if name not in SECTIONS:
        raise ConfigError(f"unknown config section {name!r}; known: {sorted(SECTIONS)}")
    return SECTIONS[name]


def root_of(cfg) -> str:
    """Which trainer config `cfg` is: "policy" (GRPO/OPD), "sft" or "eval_root"."""
    if "objective" in cfg:
        return "policy"
    if "data" in cfg:
        return "sft"
    return "eval_root"


_NO_DEFAULT = object()


def declared_default(root: str, dotted: str):
    """The schema default of key `dotted` ("teachers.served.retries") of a `root` config, or
    `_NO_DEFAULT` when the schema declares none there (an undeclared key, a free-form map's
    entry, an objective option)."""
    fields = SECTIONS.get(root, {})
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        f = fields.get(part) if isinstance(fields, dict) else None
        if f is None:
            return _NO_DEFAULT
        if isinstance(f, Sub):
            fields = SECTIONS.get(f.name, {})
            continue
        return _copy(f.default) if i == len(parts) - 1 else _NO_DEFAULT
    return _NO_DEFAULT


def added_with_default(root: str, dotted: str, value) -> bool:
    """True when a key that a config written by an older version lacks holds its schema
    default here (a key added since, which changes nothing)."""
    default = declared_default(root, dotted)
    if default is _NO_DEFAULT:
        return False
    norm = lambda v: json.loads(json.dumps(v, default=str))   # noqa: E731  (tuples, ConfigDicts)
    return norm(default) == norm(value)


def validate(cfg, root: str | None = None, *, where: str = "") -> None:
    """Raise ConfigError (one line naming the key) at the first value of `cfg` outside its
    declared type and range, or a key the schema does not declare. `where` prefixes the
    message (an experiment's stage name)."""
    try:
        _walk(cfg, _section(root or root_of(cfg)), "")
    except ConfigError as e:
        if where:
            raise ConfigError(f"{where}: {e}") from None
        raise


def _walk(node, fields: dict, prefix: str) -> None:
    for key in node.keys():
        dotted = prefix + key
        if key not in fields:
            raise ConfigError(f"config key {dotted!r} is not in the schema; known keys of "
                              f"{prefix.rstrip('.') or 'the config'}: "
                              f"{', '.join(sorted(fields))}")
        f, value = fields[key], node[key]
        if isinstance(f, Sub):
            if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
                raise ConfigError(f"{dotted}={value!r}: expected a section")
            if f.name == "objective.options":
                _walk_options(node, value, dotted + ".")
            else:
                _walk(value, _section(f.name), dotted + ".")
        else:
            f.check(dotted, value)


def _walk_options(objective, options, prefix: str) -> None:
    """objective.options against the fields the named objective declares."""
    name = objective["name"]
    if name not in OBJECTIVES:
        raise ConfigError(f"objective.name={name!r}: expected one of "
                          f"{', '.join(repr(n) for n in sorted(OBJECTIVES))} (the registered "
                          f"objectives)")
    cls = OBJECTIVES[name]
    fields = option_fields(cls)
    nested = {"correction"} & {f.name for f in dataclasses.fields(cls)}
    for key in options.keys():
        if key not in fields and key not in nested:
            raise ConfigError(f"config key {prefix + key!r} is not an option of objective "
                              f"{objective['name']!r}; its options: {', '.join(sorted(fields))}")
        value = options[key]
        if key == "correction" and isinstance(value, (Mapping, ml_collections.ConfigDict)):
            _walk(value, option_fields(Correction), prefix + key + ".")
        elif key == "correction":      # a kind alone: None, "icepop", "tis"
            option_fields(Correction)["kind"].check(prefix + key, value)
        else:
            fields[key].check(prefix + key, value)


def validate_experiment(c) -> None:
    """An experiment config's own values (section "experiment"); a sub-section the schema
    does not declare is a stage template (a trainer config), checked with its stages."""
    fields = _section("experiment")
    own = ml_collections.ConfigDict({k: v for k, v in c.items()
                                     if k in fields or not isinstance(
                                         v, (Mapping, ml_collections.ConfigDict))})
    _walk(own, fields, "")


def numeric_fields(root: str, cfg=None) -> list[tuple[str, Field]]:
    """(dotted key, Field) of every numeric field of `root`; with `cfg`, only the keys it
    has, and for a policy config its objective's numeric options too (what the schema test
    walks)."""
    out = []

    def walk(fields, node, prefix):
        for key, f in fields.items():
            if node is not None and key not in node:
                continue
            sub = None if node is None else node[key]
            if isinstance(f, Sub):
                if f.name != "objective.options":
                    walk(_section(f.name), sub, prefix + key + ".")
            elif f.numeric:
                out.append((prefix + key, f))
    walk(_section(root), cfg, "")
    if cfg is not None and root == "policy":
        for key, f in option_fields(OBJECTIVES[cfg.objective.name]).items():
            if key in cfg.objective.options and f.numeric:
                out.append((f"objective.options.{key}", f))
        if "correction" in cfg.objective.options:
            out += [(f"objective.options.correction.{k}", f)
                    for k, f in option_fields(Correction).items() if f.numeric]
    return out
