"""Multi-stage experiments: a list of stages (SFT, GRPO, OPD, merge), each a resumable run.

A stage names its trainer config (a full ConfigDict, saved with the run) and the stages it
starts from (`init_from`) or distills from (`teachers`: teacher key -> stage name). Stages
run in order, each in ``<workdir>/<stage name>``; a finished stage leaves ``done.json``
(wall time, optimizer steps) and is skipped on the next call, an unfinished one resumes from
its own checkpoints, so a killed experiment restarted with the same command loses at most
one checkpoint interval of one stage.

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
import time
from collections.abc import Mapping, Sequence

import ml_collections

log = logging.getLogger(__name__)
KINDS = ("sft", "grpo", "opd", "merge")


@dataclasses.dataclass
class Stage:
    """One run of an experiment.

    kind "merge": `config` holds ``method`` ("average" | "task_arithmetic"), ``scale`` and
    optional ``weights``; `teachers` lists the models to merge (key -> stage) and `init_from`
    is the base for task arithmetic.
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


def check_stages(stages: Sequence[Stage]) -> None:
    """Names are unique and every reference points to an earlier stage (before any work)."""
    seen: set[str] = set()
    for s in stages:
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


def run_stage(stage: Stage, workdir: str, *, progress: bool = True) -> dict:
    """Run (or resume, or skip if done) one stage; returns its done.json record."""
    if is_done(workdir, stage.name):
        return read_done(workdir, stage.name)
    out_dir = stage_dir(workdir, stage.name)
    cfg = resolved_config(stage, workdir)
    t0 = time.time()
    if stage.kind == "sft":
        from opd_jax.trainers.run_sft import train_sft
        out = train_sft(cfg, out_dir, progress=progress)
        record = {"optimizer_steps": int(out["step"]), "iterations": int(out["step"])}
    elif stage.kind in ("grpo", "opd"):
        from opd_jax.trainers.run_policy import train_policy
        out = train_policy(cfg, out_dir, progress=progress)
        record = {"iterations": int(cfg.train.steps),
                  "optimizer_steps": int(cfg.train.steps * cfg.rl.ppo_epochs *
                                         cfg.rl.minibatches)}
    else:
        record = _merge(stage, cfg, workdir, out_dir)
    record |= {"stage": stage.name, "kind": stage.kind, "wall_s": round(time.time() - t0, 1)}
    tmp = os.path.join(out_dir, "done.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "done.json"))
    return record


def _merge(stage: Stage, cfg, workdir: str, out_dir: str) -> dict:
    from opd_jax.models import save_pretrained
    from opd_jax.teachers import TeacherSpec, merge_models
    keys = sorted(stage.teachers)
    models = [TeacherSpec(stage_dir(workdir, stage.teachers[k])).load() for k in keys]
    base = TeacherSpec(stage_dir(workdir, stage.init_from)).load() if stage.init_from else None
    weights = [cfg.weights[k] for k in keys] if cfg.get("weights") else None
    merged = merge_models(models, weights=weights, method=cfg.method, base=base,
                          scale=cfg.get("scale", 1.0))
    os.makedirs(out_dir, exist_ok=True)
    save_pretrained(merged, out_dir)   # an HF folder: evaluated and loaded like any teacher
    return {"optimizer_steps": 0, "iterations": 0, "merged": keys}


def run_stages(stages: Sequence[Stage], workdir: str, *, progress: bool = True) -> dict:
    """Run every stage in order (skipping finished ones); returns {name: done record}."""
    check_stages(stages)
    os.makedirs(workdir, exist_ok=True)
    records = {}
    for i, stage in enumerate(stages):
        state = "done" if is_done(workdir, stage.name) else "running"
        print(f"[{i + 1}/{len(stages)}] {stage.kind} {stage.name}: {state}", flush=True)
        records[stage.name] = run_stage(stage, workdir, progress=progress)
    return records
