"""Shared tiny models for the rollout tests (fast random init: eval_shape + numpy fill)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opd_jax.models import ModelConfig, Transformer

# vocab 128 holds the synthetic tokenizer (112 ids); one shape for every test = few compiles
CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, arch="qwen3", rope_theta=10_000.0)


def random_model(cfg: ModelConfig = CFG, seed: int = 0, std: float = 0.3) -> Transformer:
    """Weights ~ N(0, std) (peaked enough that greedy/top-p choices are not near ties)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        x = rng.standard_normal(var.get_value().shape).astype(np.float32)
        x = 1.0 + 0.2 * x if path[-1] == "scale" else std * x
        var.set_value(jnp.asarray(x, cfg.params_dtype))
    return nnx.merge(graphdef, state)


class CompileCounter:
    """Counts XLA backend compiles while active (jax.monitoring duration events)."""

    def __init__(self):
        self.count, self.on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if self.on and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        self.count, self.on = 0, True
        return self

    def __exit__(self, *exc):
        self.on = False


@nnx.jit
def full_logits(model, tokens_BxT, mask_BxT):
    """Teacher-forced no-cache forward (positions from the mask)."""
    return model(tokens_BxT, attention_mask_BxT=mask_BxT)
