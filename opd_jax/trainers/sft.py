"""SFT: a pure train step with exact gradient accumulation.

Legend: B batch, T tokens, V vocab, M micro-batches.

The loss is the masked token mean over the *whole* batch, - sum_t m_t lp(y_t) / sum_t m_t;
with ``grad_accum = M`` the batch is split into M micro-batches whose token sums are
divided by the full-batch token count, so the update equals the unaccumulated one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from opd_jax.losses import sft_loss, token_logprobs
from opd_jax.trainers.state import TrainState


def sft_micro_loss(params, rest, graphdef, batch, n_total):
    """Sum of masked token NLL of one micro-batch divided by the full-batch token count."""
    model = nnx.merge(graphdef, params, rest)
    logits_BxTxV = model(batch["inputs"], positions_BxT=batch["positions"],
                         segment_ids_BxT=batch["segment_ids"])
    logp_BxT = token_logprobs(logits_BxTxV, batch["targets"])
    loss, metrics = sft_loss(logp_BxT, batch["mask"])
    n_micro = jnp.sum(batch["mask"]).astype(jnp.float32)
    return loss * n_micro / n_total, metrics


def sft_step(state: TrainState, batch: dict, *, graphdef: nnx.GraphDef,
             tx: optax.GradientTransformation, grad_accum: int = 1
             ) -> tuple[TrainState, dict]:
    """One optimizer step on `batch` ({inputs, targets, mask, segment_ids, positions}: [B, T])."""
    B = batch["inputs"].shape[0]
    if B % grad_accum:
        raise ValueError(f"batch size {B} is not divisible by grad_accum {grad_accum}")
    n_total = jnp.maximum(jnp.sum(batch["mask"]).astype(jnp.float32), 1.0)
    grad_fn = jax.value_and_grad(sft_micro_loss, has_aux=True)
    if grad_accum == 1:
        (loss, _), grads = grad_fn(state.params, state.rest, graphdef, batch, n_total)
    else:
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, B // grad_accum, *x.shape[1:]),
                             batch)

        def body(carry, mb):
            loss_acc, g_acc = carry
            (loss, _), g = grad_fn(state.params, state.rest, graphdef, mb, n_total)
            return (loss_acc + loss, jax.tree.map(jnp.add, g_acc, g)), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
               "update_norm": optax.global_norm(updates), "tokens": n_total}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
