"""ModelConfig.remat: same losses and gradients, fewer saved residuals, decode untouched.

The memory saving is checked on the traced backward (`saved_residuals`, the function behind
`jax.ad_checkpoint.print_saved_residuals`): XLA:CPU drops the optimization barriers that
keep a recomputation in the backward and schedules it next to the forward, so the CPU
backend's compiled temp size does not show the saving that TPU and GPU get.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import remat_p, saved_residuals
from tests.models.helpers import random_model, random_tokens, with_config

from opd_jax.models import ModelConfig, Transformer, config_from_hf, config_to_hf
from opd_jax.models.config import EXECUTION_FIELDS, REMATS
from opd_jax.models.transformer import remat_policy

# q/k/v biases and q/k norms on, untied: every parameter kind gets a gradient.
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, arch="qwen3", qkv_bias=True)
B, T = 2, 12
TOKENS = random_tokens(B, T + 1, CFG.vocab_size, seed=3)
# Two packed documents per row, padding at the end of the first row.
SEGMENTS = jnp.asarray([[1] * 5 + [2] * 5 + [0] * 2, [1] * 8 + [2] * 4], jnp.int32)


def _loss(params, graphdef, rest, hidden: bool):
    """Masked token NLL of a packed batch, through the logits or through return_hidden."""
    model = nnx.merge(graphdef, params, rest)
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]
    if hidden:
        out = model.logits(model(x, segment_ids_BxT=SEGMENTS, return_hidden=True))
    else:
        out = model(x, segment_ids_BxT=SEGMENTS)
    logp_BxT = jnp.take_along_axis(jax.nn.log_softmax(out.astype(jnp.float32)), y[..., None],
                                   axis=-1)[..., 0]
    mask = (SEGMENTS != 0).astype(jnp.float32)
    return -(logp_BxT * mask).sum() / mask.sum()


@pytest.fixture(scope="module")
def base():
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def reference(base):
    """(loss, grads) without remat, through the logits and through return_hidden."""
    return {hidden: _value_and_grad(base, hidden) for hidden in (False, True)}


def _value_and_grad(model, hidden):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = jax.jit(jax.value_and_grad(_loss), static_argnums=(1, 3))
    return fn(params, graphdef, rest, hidden)


def test_remat_values_are_checked():
    assert CFG.remat == "none" and REMATS == ("none", "layer", "dots")
    with pytest.raises(ValueError, match=r"remat='block': expected one of \('none', 'layer', "
                                         r"'dots'\)"):
        CFG.replace(remat="block")
    with pytest.raises(ValueError, match="remat='none' has no checkpoint policy"):
        remat_policy("none")
    cfg = CFG.replace(remat="layer")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    # Not an architecture field: merges / init_from / resume checks ignore it ...
    assert "remat" in EXECUTION_FIELDS and cfg.architecture() == CFG.architecture()
    assert "remat" not in cfg.architecture() and "num_layers" in cfg.architecture()
    # ... and Hugging Face's config.json neither writes nor reads it.
    assert config_to_hf(cfg) == config_to_hf(CFG)
    assert config_from_hf(config_to_hf(cfg)).remat == "none"
    assert config_from_hf(config_to_hf(cfg), remat="layer").remat == "layer"


@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "return_hidden"])
@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_loss_and_grads_equal_without_remat(base, reference, remat, hidden):
    ref_loss, ref_grads = reference[hidden]
    loss, grads = _value_and_grad(with_config(base, remat=remat), hidden)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    ref_flat, flat = nnx.to_flat_state(ref_grads), nnx.to_flat_state(grads)
    assert [p for p, _ in flat] == [p for p, _ in ref_flat]
    for (path, g), (_, ref) in zip(flat, ref_flat):
        ref = np.asarray(ref.get_value())
        assert np.abs(ref).max() > 0, path
        np.testing.assert_allclose(np.asarray(g.get_value()), ref, rtol=1e-5, atol=1e-6,
                                   err_msg="/".join(map(str, path)))


def _saved(cfg, tokens_BxT):
    """Shapes and bytes of every residual the backward keeps, the parameters excluded."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tokens_BxT)
        return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))

    return [(tuple(a.shape), a.size * a.dtype.itemsize) for a, where in
            saved_residuals(loss, params) if not where.startswith("from the argument")]


def test_layer_remat_saves_only_layer_inputs():
    Tl, L = 64, 4
    tokens = jnp.zeros((B, Tl), jnp.int32)
    saved = {r: _saved(CFG.replace(num_layers=L, remat=r), tokens) for r in REMATS}
    is_attn = lambda shape: len(shape) >= 4 and shape[-2:] == (Tl, Tl)  # noqa: E731
    # Without remat every layer keeps its [B, K, G, T, T] scores / probabilities.
    assert sum(is_attn(s) for s, _ in saved["none"]) >= 2 * L
    assert not any(is_attn(s) for r in ("layer", "dots") for s, _ in saved[r])
    # "layer": two more layers keep exactly two more arrays, each a [B, T, D] layer output
    # (the next layer's input).
    fewer = _saved(CFG.replace(num_layers=L - 2, remat="layer"), tokens)
    extra = list(saved["layer"])
    for item in fewer:
        extra.remove(item)
    D = CFG.hidden_size
    assert extra == [((B, Tl, D), B * Tl * D * 4)] * 2
    # The attention was most of it: remat keeps a small fraction of the bytes.
    total = {r: sum(n for _, n in s) for r, s in saved.items()}
    assert total["layer"] < total["none"] / 4
    assert total["layer"] < total["dots"] < total["none"]


def _primitives(jaxpr) -> list[str]:
    """Names of every primitive in `jaxpr`, nested jaxprs (pjit, remat) included."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _primitives(sub)
    return out


def test_decode_path_and_forward_unaffected(base):
    model = with_config(base, remat="layer")
    x = TOKENS[:, :6]
    n_remat = lambda f: _primitives(jax.make_jaxpr(f)().jaxpr).count(remat_p.name)  # noqa
    # One checkpoint per layer in the no-cache call, none with a cache.
    assert n_remat(lambda: model(x)) == CFG.num_layers
    cache = model.init_cache(B, 8)
    pos = jnp.broadcast_to(jnp.arange(6), (B, 6))
    assert n_remat(lambda: model(x, positions_BxT=pos, cache=cache)) == 0
    assert n_remat(lambda: base(x)) == 0
    # Forward values: identical.
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m: m(x))(model)),
                                  np.asarray(nnx.jit(lambda m: m(x))(base)))
