"""Train state, optimizer and the one place where jit, shardings and donation are applied.

A model is split once into a static ``graphdef`` and array state; train steps are pure
functions ``step(state, batch) -> (state, metrics)`` that rebuild the module with
``nnx.merge(graphdef, state.params, state.rest)`` inside the trace.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from opd_jax import sharding as sh


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes. ``rest`` holds non-trainable model variables."""
    step: jax.Array
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState


def make_optimizer(o: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
    """AdamW (or SGD) with linear warmup then cosine (or constant) decay and grad clipping."""
    warmup = min(int(o.warmup_steps), max(total_steps - 1, 0))
    if o.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)
    elif o.schedule == "constant":
        lr = optax.join_schedules(
            [optax.linear_schedule(0.0, o.lr, max(warmup, 1)), optax.constant_schedule(o.lr)],
            [warmup])
    else:
        raise ValueError(f"optim.schedule {o.schedule!r}: expected 'cosine' or 'constant'")
    if o.name == "adamw":
        opt = optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == "sgd":
        opt = optax.sgd(lr)
    else:
        raise ValueError(f"optim.name {o.name!r}: expected 'adamw' or 'sgd'")
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip and o.grad_clip > 0 else []
    return optax.chain(*parts, opt)


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest


def create_state(model: nnx.Module, tx: optax.GradientTransformation
                 ) -> tuple[nnx.GraphDef, TrainState]:
    graphdef, params, rest = split_model(model)
    opt_state = tx.init(params)
    return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                                opt_state=opt_state)


def state_shardings(state: TrainState, mesh: Mesh, rules=sh.DEFAULT_RULES) -> TrainState:
    """Params and optimizer moments by logical axes; scalars (step, Adam count) replicated.

    Optax moments mirror the param tree (with its NNX metadata), so the same rules apply.
    """
    return sh.state_shardings(state, mesh, rules)


def place_state(state: TrainState, mesh: Mesh, rules=sh.DEFAULT_RULES
                ) -> tuple[TrainState, TrainState]:
    """Place `state` by its shardings (works when the mesh spans several processes: every
    process must hold the same state, e.g. built from the same seed)."""
    shardings = state_shardings(state, mesh, rules)
    return sh.place(state, shardings), shardings


def guard_nonfinite(step_fn: Callable, *, skip: bool = False) -> Callable:
    """`step_fn` with a ``nonfinite`` metric: 1.0 when its loss or grad_norm is NaN or inf.

    With ``skip`` such a step keeps the previous params, model variables and optimizer
    state (only ``step`` advances), so a bounded number of bad batches can be stepped over
    (`opd_jax.trainers.metrics.DivergenceGuard` counts them and stops past the bound)."""
    def guarded(state, batch, *extra):
        new, metrics = step_fn(state, batch, *extra)
        bad = ~(jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]))
        if skip:
            keep = lambda n, o: jnp.where(bad, o, n)  # noqa: E731
            new = new.replace(params=jax.tree.map(keep, new.params, state.params),
                              rest=jax.tree.map(keep, new.rest, state.rest),
                              opt_state=jax.tree.map(keep, new.opt_state, state.opt_state))
        return new, dict(metrics, nonfinite=bad.astype(jnp.float32))
    return guarded


def compile_step(step_fn: Callable, state_shardings_: Any, mesh: Mesh, *,
                 extra_shardings: tuple = (), donate: bool = True,
                 skip_nonfinite: bool = False, rules: sh.Rules = sh.DEFAULT_RULES) -> Callable:
    """jit `step_fn(state, batch, *extra)` with shardings and state donation (the one jit site).

    Every step reports ``nonfinite`` (see `guard_nonfinite`; ``skip_nonfinite`` keeps the
    previous state on such a step).

    Batch leaves are [B, ...] arrays sharded over the `batch` logical axis; `extra` arguments
    (e.g. teacher unembeddings) take `extra_shardings`; metrics come back replicated.

    Multi-process: the state and batch must already be global arrays (`place_state`,
    `sh.shard_batch`); `extra` arguments are placed here with `sh.put`, so a process-local
    array (a teacher loaded on each process) is accepted. The jitted function is
    ``.jitted`` of the returned callable.
    """
    # the run's rules: the batch axis is where `sh.shard_batch(..., rules)` put it
    batch_sharding = NamedSharding(mesh, sh.logical_to_spec(("batch",), rules, mesh))
    jitted = jax.jit(guard_nonfinite(step_fn, skip=skip_nonfinite),
                     in_shardings=(state_shardings_, batch_sharding, *extra_shardings),
                     out_shardings=(state_shardings_, NamedSharding(mesh, P())),
                     donate_argnums=(0,) if donate else ())

    def step(state, batch, *extra):
        return jitted(state, batch, *sh.place(tuple(extra), tuple(extra_shardings)))
    step.jitted = jitted
    return step
