"""Fast random models for tests (eval_shape + numpy fill: no per-op XLA compiles), and
`ScriptedPolicy`, a model that writes fixed transcripts through the rollout engine."""
import jax
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


class ScriptedPolicy(nnx.Module):
    """A model that writes fixed transcripts: at position p, row b predicts token p + 1 of
    `script_BxL[b]` (-1: the wrapped model's own logits). Greedy sampling through the
    rollout engine (cache, stop strings, forced tokens) then writes each row's script."""

    def __init__(self, inner: Transformer, script_BxL):
        self.inner, self.config = inner, inner.config
        self.script = nnx.Variable(jnp.asarray(script_BxL, jnp.int32))

    def init_cache(self, *args, **kwargs):
        return self.inner.init_cache(*args, **kwargs)

    def __call__(self, tokens_BxT, *, positions_BxT, cache, attention_mask_BxT=None):
        logits_BxTxV, cache = self.inner(tokens_BxT, positions_BxT=positions_BxT, cache=cache,
                                         attention_mask_BxT=attention_mask_BxT)
        s_BxL = self.script[...]
        nxt_BxT = jnp.take_along_axis(s_BxL, jnp.clip(positions_BxT + 1, 0, s_BxL.shape[1] - 1),
                                      axis=1)
        onehot_BxTxV = jax.nn.one_hot(nxt_BxT, logits_BxTxV.shape[-1]) * 1e4
        return jnp.where((nxt_BxT >= 0)[..., None], onehot_BxTxV, logits_BxTxV), cache


def script_rows(rows_ids, pad: int = 8) -> np.ndarray:
    """[B, L] script of token-id rows (each its full sequence from position 0), -1 after."""
    script = np.full((len(rows_ids), max(map(len, rows_ids)) + pad), -1, np.int32)
    for b, row in enumerate(rows_ids):
        script[b, :len(row)] = row
    return script
