"""Multi-stage experiments: a list of stages (SFT, GRPO, OPD, merge), each a resumable run.

A stage names its trainer config (a full ConfigDict, saved with the run) and the stages it
starts from (`init_from`) or distills from (`teachers`: teacher key -> stage name). Stages
run in order, each in ``<workdir>/<stage name>``; a finished stage leaves ``done.json``
(wall time, compile time, optimizer steps) and is skipped on the next call, an unfinished
one resumes from its own checkpoints, so a killed experiment restarted with the same command
loses at most one checkpoint interval of one stage. Its times are those of the run that
finished the stage: ``wall_s``, ``compile_s`` (XLA compiles and lowering to MLIR),
``trace_s`` (tracing Python to jaxprs) and ``compiles`` (XLA compiles; see CompileClock);
records written before compile times were kept lack the last three. ``compute`` is the
run's tokens and FLOPs (`trainers.compute`; None for a merge). ``done.json`` also
records what the stage was (kind, config, references): calling again with a *changed* stage
under the same name is refused, naming the keys that differ, instead of silently reusing a
result of other settings.

    stages = [Stage("sft", "sft", sft_cfg),
              Stage("rl_max", "grpo", grpo_cfg, init_from="sft"),
              Stage("student", "opd", opd_cfg, init_from="sft", teachers={"general/max": "rl_max"})]
    run_stages(stages, "runs/exp")
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence

import jax
import ml_collections

from opd_jax.models import ModelRef, save_pretrained
from opd_jax.teachers import merge_models
from opd_jax.trainers import compute, config_schema, run_policy, run_sft

log = logging.getLogger(__name__)
KINDS = ("sft", "grpo", "opd", "merge")
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileClock:
    """Seconds JAX spends compiling while the block runs, from jax.monitoring's events.

    ``compile_s``: XLA backend compiles plus lowering to MLIR; ``trace_s``: tracing Python
    to jaxprs (a trace nested in another is counted in both); ``compiles``: XLA compiles;
    ``log``: (time.perf_counter() at the end, seconds) of each compile and lowering.

    >>> with CompileClock() as clock:
    ...     train_policy(cfg, workdir)
    >>> clock.record()   # {"compile_s": ..., "trace_s": ..., "compiles": ...}
    """

    def __init__(self):
        self.compile_s, self.trace_s, self.compiles = 0.0, 0.0, 0
        self.log: list[tuple[float, float]] = []

    def _listen(self, event: str, duration: float, **_):
        if event in (_COMPILE, _LOWER):
            self.compile_s += duration
            self.log.append((time.perf_counter(), duration))
            self.compiles += event == _COMPILE
        elif event == _TRACE:
            self.trace_s += duration

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def record(self) -> dict:
        return {"compile_s": round(self.compile_s, 1), "trace_s": round(self.trace_s, 1),
                "compiles": self.compiles}


@dataclasses.dataclass
class Stage:
    """One run of an experiment.

    kind "merge": `config` holds ``method`` ("average" | "task_arithmetic"), ``scale`` and
    optional ``weights``; `teachers` lists the models to merge (key -> stage) and `init_from`
    is the base for task arithmetic (or, when the base is no stage, ``config.base``: a
    checkpoint path or ``builtin:NAME``).
    """
    name: str
    kind: str
    config: ml_collections.ConfigDict
    init_from: str | None = None
    teachers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"stage {self.name!r}: kind={self.kind!r}, expected one of {KINDS}")
        if self.kind == "opd" and not self.teachers:
            raise ValueError(f"stage {self.name!r}: an OPD stage needs teachers")


def stage_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, name)


def is_done(workdir: str, name: str) -> bool:
    return os.path.isfile(os.path.join(stage_dir(workdir, name), "done.json"))


def read_done(workdir: str, name: str) -> dict:
    with open(os.path.join(stage_dir(workdir, name), "done.json"), encoding="utf-8") as f:
        return json.load(f)


def stage_identity(stage: Stage) -> dict:
    """What a finished stage was run with: kind, config (as JSON values) and references."""
    return json.loads(json.dumps({"kind": stage.kind, "config": stage.config.to_dict(),
                                  "init_from": stage.init_from,
                                  "teachers": dict(stage.teachers)}, default=str))


def _flat(d, prefix=""):
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def check_same_stage(stage: Stage, record: dict, workdir: str) -> None:
    """A finished stage is reused only if it was run with the same identity (records written
    before identities were stored are accepted)."""
    old = record.get("identity")
    if old is None:
        return
    new = stage_identity(stage)
    if old == new:
        return
    a, b = _flat(old), _flat(new)
    root = "merge" if stage.kind == "merge" else config_schema.root_of(stage.config)
    # A key the old record lacks that holds its schema default now was added since (by a
    # newer version of the code): the same stage.
    added = {k for k in b.keys() - a.keys() if k.startswith("config.")
             and config_schema.added_with_default(root, k[len("config."):], b[k])}
    diff = sorted(k for k in (a.keys() | b.keys()) - added
                  if a.get(k, "<absent>") != b.get(k, "<absent>"))
    if not diff:
        return
    shown = ", ".join(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
                      for k in diff[:6])
    raise ValueError(
        f"stage {stage.name!r} in {stage_dir(workdir, stage.name)} finished with other settings "
        f"({len(diff)} differ: {shown}{', ...' if len(diff) > 6 else ''}); expected the same "
        "stage as before: delete that directory to re-run it, or use a new workdir")


def check_stages(stages: Sequence[Stage]) -> None:
    """Names are unique, every reference points to an earlier stage and every stage's config
    holds to the schema (`schema.validate`), before any work or write."""
    seen: set[str] = set()
    for s in stages:
        config_schema.validate(s.config, "merge" if s.kind == "merge" else None,
                        where=f"stage {s.name!r}")
        if s.name in seen:
            raise ValueError(f"stage name {s.name!r} appears twice")
        for ref in ([s.init_from] if s.init_from else []) + list(s.teachers.values()):
            if ref not in seen:
                raise ValueError(f"stage {s.name!r} refers to {ref!r}, which is not an earlier "
                                 f"stage (earlier: {sorted(seen)})")
        seen.add(s.name)


def resolved_config(stage: Stage, workdir: str) -> ml_collections.ConfigDict:
    """The stage's trainer config with stage references replaced by their workdirs."""
    cfg = ml_collections.ConfigDict(stage.config.to_dict())
    if stage.kind == "merge":
        return cfg
    if stage.init_from:
        cfg.model.init_from = stage_dir(workdir, stage.init_from)
    if stage.teachers:
        cfg.teachers.paths = {k: stage_dir(workdir, v) for k, v in stage.teachers.items()}
    return cfg


# The source checkout (git) whose commit results record (`code_commit`).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_commit() -> str:
    """The short commit of the code a result was measured with; "-dirty" when the package,
    the studies, the notebooks or the experiment configs differ from it, new files included
    (uncommitted changes that could move results)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", "opd_jax", "studies",
             "notebooks/*.ipynb", "experiments/*/config.py"],
            cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
        return head + "-dirty" if changed else head
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_stage(stage: Stage, workdir: str, *, progress: bool = True) -> dict:
    """Run (or resume, or skip if done) one stage; returns its done.json record."""
    if is_done(workdir, stage.name):
        record = read_done(workdir, stage.name)
        check_same_stage(stage, record, workdir)
        return record
    out_dir = stage_dir(workdir, stage.name)
    cfg = resolved_config(stage, workdir)
    t0 = time.time()
    with CompileClock() as clock:
        if stage.kind == "sft":
            out = run_sft.train_sft(cfg, out_dir, progress=progress)
            record = {"optimizer_steps": int(out["step"]), "iterations": int(out["step"])}
        elif stage.kind in ("grpo", "opd"):
            out = run_policy.train_policy(cfg, out_dir, progress=progress)
            record = {"iterations": int(cfg.train.steps),
                      "optimizer_steps": int(cfg.train.steps * cfg.rl.ppo_epochs *
                                             cfg.rl.minibatches)}
        else:
            record = _merge(stage, cfg, workdir, out_dir)
    record |= {"stage": stage.name, "kind": stage.kind, "wall_s": round(time.time() - t0, 1),
               "commit": code_commit(), **clock.record(), "identity": stage_identity(stage),
               "compute": compute.read(out_dir)}
    tmp = os.path.join(out_dir, "done.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "done.json"))
    return record


def _merge(stage: Stage, cfg, workdir: str, out_dir: str) -> dict:
    keys = sorted(stage.teachers)
    refs = [ModelRef(stage_dir(workdir, stage.teachers[k])) for k in keys]
    base_path = stage_dir(workdir, stage.init_from) if stage.init_from else cfg.get("base")
    base_ref = ModelRef(base_path) if base_path else None
    tokenizer = merge_tokenizer([*refs, *([base_ref] if base_ref else [])], stage.name)
    models = [r.load() for r in refs]
    base = base_ref.load() if base_ref else None
    weights = [cfg.weights[k] for k in keys] if cfg.get("weights") else None
    merged = merge_models(models, weights=weights, method=cfg.method, base=base,
                          scale=cfg.get("scale", 1.0))
    os.makedirs(out_dir, exist_ok=True)
    # An HF folder (evaluated and loaded like any teacher) recording the models' tokenizer.
    save_pretrained(merged, out_dir, tokenizer=tokenizer)
    return {"optimizer_steps": 0, "iterations": 0, "merged": keys}


def merge_tokenizer(refs: Sequence[ModelRef], name: str) -> dict | None:
    """The one tokenizer the models of a merge were trained with (``{"spec",
    "fingerprint"}``, None when none records one); a clear error when they differ: their
    token ids would mean other text, so averaging their rows is meaningless."""
    seen = {}
    for ref in refs:
        ident = ref.tokenizer_identity()
        if ident is not None:
            seen.setdefault(ident[1], (ident[0], ref.path))
    if len(seen) > 1:
        listed = "; ".join(f"{path} ({spec!r}, fingerprint {fp})"
                           for fp, (spec, path) in seen.items())
        raise ValueError(f"merge stage {name!r}: its models were trained with different "
                         f"tokenizers: {listed}; expected one tokenizer")
    return next(({"spec": spec, "fingerprint": fp} for fp, (spec, _) in seen.items()), None)


def check_finished(stages: Sequence[Stage], workdir: str) -> None:
    """Refuse, before any work or write, a finished stage asked for with other settings."""
    for stage in stages:
        if is_done(workdir, stage.name):
            check_same_stage(stage, read_done(workdir, stage.name), workdir)


def run_stages(stages: Sequence[Stage], workdir: str, *, progress: bool = True) -> dict:
    """Run every stage in order (skipping finished ones); returns {name: done record}."""
    check_stages(stages)
    check_finished(stages, workdir)   # a changed finished stage is refused up front
    os.makedirs(workdir, exist_ok=True)
    records = {}
    for i, stage in enumerate(stages):
        state = "done" if is_done(workdir, stage.name) else "running"
        print(f"[{i + 1}/{len(stages)}] {stage.kind} {stage.name}: {state}", flush=True)
        records[stage.name] = run_stage(stage, workdir, progress=progress)
    return records
