"""Fast random models for tests: eval_shape + numpy fill (no per-op XLA compiles)."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.models import ModelConfig, Transformer


def random_model(cfg: ModelConfig, seed: int = 0, std: float = 0.1) -> Transformer:
    """Weights ~ N(0, std); norm scales ~ 1 + N(0, 0.2); biases ~ N(0, 0.1)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        shape = var.get_value().shape
        x = rng.standard_normal(shape).astype(np.float32)
        if path[-1] == "scale":
            x = 1.0 + 0.2 * x
        elif path[-1].endswith("_bias"):
            x = 0.1 * x
        else:
            x = std * x
        var.set_value(jnp.asarray(x, cfg.params_dtype))
    return nnx.merge(graphdef, state)


def with_config(model: Transformer, **changes) -> Transformer:
    """The same parameters under a changed config (e.g. dtype="bfloat16"); parameters the
    new config lacks (lm_head when tied) are dropped."""
    cfg = model.config.replace(**changes)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    old = dict(nnx.to_flat_state(nnx.state(model)))
    flat = list(nnx.to_flat_state(state))
    for path, var in flat:
        var.set_value(old[path].get_value())
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def random_tokens(B: int, T: int, vocab: int, seed: int = 0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (B, T)), jnp.int32)
