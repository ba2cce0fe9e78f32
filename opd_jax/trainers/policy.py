"""Pure steps for the policy trainers (GRPO and the OPD objectives).

``policy_step(state, batch, teachers)`` takes one optimizer step on `batch` with the
configured objective; ``batch_logprobs`` is the training-engine forward that recomputes
old log-probs (IcePop compares it with the sampler's). (A teacher's forward,
``teacher_outputs``, lives with the teachers: `opd_jax.teachers.scoring`.) All are pure
functions of arrays; jit is applied by the caller in one place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from opd_jax import losses
from opd_jax.trainers.objectives import behaviour_logprobs
from opd_jax.trainers.state import TrainState


def policy_step(state: TrainState, batch: dict, teachers: tuple = (), *, graphdef, tx,
                objective) -> tuple[TrainState, dict]:
    def loss_fn(params):
        model = nnx.merge(graphdef, params, state.rest)
        return objective(model, batch, teachers)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # update_norm: the length of this step in parameter space (summed over steps: the path
    # length the speed study sets against the distance travelled)
    metrics = dict(metrics) | {"loss": loss, "grad_norm": optax.global_norm(grads),
                               "update_norm": optax.global_norm(updates)}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def batch_logprobs(params, rest, batch: dict, *, graphdef, behaviour=None) -> dict:
    """Per-target log-probs and entropy under the training forward (fp32).

    "logp" is under the behaviour distribution (`objectives.Behaviour`, the rollout
    sampler's temperature / top-k / top-p; plain T = 1 when None or greedy), the one the
    sampler's log-probs are on; "logp_plain" and "entropy" are at T = 1.
    """
    model = nnx.merge(graphdef, params, rest)
    logits_BxTxV = model(batch["inputs"], segment_ids_BxT=batch["segment_ids"])
    plain_BxT = losses.token_logprobs(logits_BxTxV, batch["targets"])
    logp_BxT = plain_BxT if behaviour is None or behaviour.plain else behaviour_logprobs(
        logits_BxTxV, batch["targets"], behaviour)
    return {"logp": logp_BxT, "logp_plain": plain_BxT,
            "entropy": losses.token_entropy(logits_BxTxV)}


def entropy_metric(entropy_BxT, mask_BxT) -> jax.Array:
    return losses.masked_mean(entropy_BxT, mask_BxT.astype(jnp.float32))
