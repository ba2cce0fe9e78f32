"""One run skeleton, shared by SFT and the policy trainers.

    run = Run.open(cfg, workdir, kind="sft", setup=Setup.of(cfg), optimizer_steps=N,
                   iterator=data_iter)
    step_fn = run.compile(functools.partial(sft_step, graphdef=run.graphdef, tx=run.tx))
    for step in run.progress(N, desc="sft"):
        run.state, metrics = step_fn(run.state, batch)
        run.check_late(step + 1, metrics)         # the divergence check, one step late
        ...
        run.save(step + 1)                        # the state, the iterator and the meta
    run.close()

What it owns: the workdir (lock, config pin, the checkpoints' model check:
`trainers.workdir.open_workdir`), the model built or loaded onto the mesh, the optimizer
and the train state placed in its shardings and restored on resume (with the data
iterator; `initial_params`: a copy of the parameters as built, before any restore, for a
run that keeps a frozen reference policy; `step`: the state's step kept on the host), the
compiled step (`state.compile_step`, non-finite steps skipped when ``train.max_bad_steps``
allows), the divergence guard, the metrics writer, the progress bar and the checkpoint
meta (model config, tokenizer identity, run kind).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from tqdm.auto import tqdm

from opd_jax import sharding as sh
from opd_jax.checkpoint import Checkpointer, CheckpointError, WorkdirError, abstract_like
from opd_jax.models import tokenizer_meta
from opd_jax.trainers import builders
from opd_jax.trainers.metrics import DivergenceGuard, MetricsWriter
from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state
from opd_jax.trainers.workdir import open_workdir


@dataclasses.dataclass
class Setup:
    """What a run is checked against before any work (`builders.setup`)."""
    mesh: jax.sharding.Mesh
    rules: tuple
    tokenizer: Any
    model_config: Any

    @classmethod
    def of(cls, cfg: ml_collections.ConfigDict) -> Setup:
        return cls(*builders.setup(cfg))

    @property
    def layout(self) -> sh.Layout:
        """The run's device path (mesh + rules) as one object."""
        return sh.Layout(self.mesh, self.rules)


@dataclasses.dataclass
class Run:
    cfg: ml_collections.ConfigDict
    workdir: str
    setup: Setup
    ckpt: Checkpointer
    iterator: Any
    tx: Any
    graphdef: Any
    state: Any
    shardings: Any
    start: int
    guard: DivergenceGuard
    writer: MetricsWriter
    meta: dict
    initial_params: Any = None
    step: int = 0          # the state's optimizer step, kept on the host (read once, at open)
    resumed: dict = dataclasses.field(default_factory=dict)   # the restored step's meta
    _pending: tuple | None = None

    @classmethod
    def open(cls, cfg, workdir: str, *, kind: str, setup: Setup, optimizer_steps: int,
             iterator, steps_per_unit: int = 1, resume_with_changes: bool = False,
             guard_unit: str = "step", keep_initial_params: bool = False) -> Run:
        """Open the workdir, build the model and state (restored on resume with
        `iterator`). `steps_per_unit`: optimizer steps per unit of `start` (a policy
        iteration's steps; 1 for SFT). `keep_initial_params`: keep a copy of the
        parameters as built (init or `init_from`), taken before a resume restores the
        state: the frozen reference of a KL penalty is the initial policy, not the resumed
        one."""
        model_meta = setup.model_config.to_dict()
        tokenizer = tokenizer_meta(builders.tokenizer_spec(cfg), setup.tokenizer)
        ckpt, commit, changes = open_workdir(workdir, cfg, model_meta,
                                             resume_with_changes=resume_with_changes,
                                             defer_write=True, tokenizer=tokenizer)
        try:
            model = builders.build_model(cfg.model, setup.mesh, setup.rules, seed=cfg.seed)
            tx = make_optimizer(cfg.optim, optimizer_steps)
            graphdef, state = create_state(model, tx)
            state, shardings = place_state(state, setup.mesh, setup.rules)
            initial = (jax.tree.map(jnp.copy, state.params) if keep_initial_params
                       else None)
            start, resumed = 0, {}
            if ckpt.latest_step() is not None:
                try:
                    state, resumed = ckpt.restore(None, abstract_like(state), iterator)
                except CheckpointError as e:
                    optim = sorted(k for k in changes if k.startswith("optim."))
                    if not optim:
                        raise
                    raise WorkdirError(
                        f"workdir {workdir!r}: its checkpoints could not be restored under "
                        f"the changed optimizer settings ({', '.join(optim)}): the optimizer "
                        f"state saved with them has another structure ({e}); resume with "
                        f"the saved optimizer or use a new --workdir (config.json unchanged)"
                    ) from e
                start = int(state.step) // steps_per_unit
            commit()      # config.json (and the change record): the run is under it now
            guard = DivergenceGuard(cfg.train.get("max_bad_steps", 0), unit=guard_unit,
                                    lr=cfg.optim.lr)
            writer = MetricsWriter(workdir, resume_step=start)
        except BaseException:
            ckpt.close()
            raise
        meta = {"model": model_meta, "kind": kind, "tokenizer": tokenizer}
        return cls(cfg, workdir, setup, ckpt, iterator, tx, graphdef, state, shardings, start,
                   guard, writer, meta, initial, int(state.step), dict(resumed or {}))

    def compile(self, step_fn: Callable, *, extra_shardings=()) -> Callable:
        """`step_fn(state, batch, *extra)` jitted with the state's shardings (and the
        guard's non-finite skip when ``train.max_bad_steps`` > 0)."""
        return compile_step(step_fn, self.shardings, self.setup.mesh,
                            extra_shardings=extra_shardings, rules=self.setup.rules,
                            skip_nonfinite=self.guard.max_bad_steps > 0)

    def check_late(self, step: int, metrics: dict) -> None:
        """The divergence check of the previous step (its metrics are ready by now, so the
        host never waits on the step just dispatched); this step's is held until the next
        call or `check_now`."""
        if self._pending is not None:
            self.guard.check(*self._pending, last_checkpoint=self.ckpt.latest_step())
        self._pending = (step, metrics)

    def check_now(self) -> None:
        """The held check, now (before a save or a log, and at the end)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.guard.check(*pending, last_checkpoint=self.ckpt.latest_step())

    def progress(self, total: int, *, desc: str, enabled: bool = True):
        return tqdm(range(self.start, total), initial=self.start, total=total, desc=desc,
                    disable=not enabled or jax.process_index() != 0, dynamic_ncols=True)

    @staticmethod
    def due(done: int, every: int, total: int) -> bool:
        return done % every == 0 or done == total

    def save(self, step: int, **meta) -> None:
        self.check_now()
        self.ckpt.save(step, self.state, self.iterator, self.meta | meta)

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()

