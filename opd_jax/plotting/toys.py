"""Toy experiments behind the notebooks (notebooks/*.ipynb): pure JAX/numpy, returning arrays
that the ``plot_*`` functions of :mod:`opd_jax.plotting.figures` draw.

Shape letters: V vocab (or grid points), N samples / tokens, R repeats, B batch, T tokens.

    grid_V = jnp.linspace(-4, 4, 81)
    target_logp_V = bimodal_logp(grid_V)
    fit = fit_unimodal(target_logp_V, grid_V, "reverse")      # sits on one mode
    fig = plot_mode_seeking(grid_V, target_logp_V, {"reverse KL": fit["logp_V"]})
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from opd_jax import losses
from pallas_kernels import fused_clipped_log_ratio, fused_reverse_kl

DIRECTIONS = ("reverse", "forward")


# ----------------------------------------------------------------------------------------
# 01: reverse vs forward KL on a bimodal target
# ----------------------------------------------------------------------------------------

def gaussian_logits(grid_V: jax.Array, mu, log_sigma) -> jax.Array:
    """Logits of a Gaussian discretized on `grid_V`: -(x - mu)^2 / (2 sigma^2)."""
    return -0.5 * jnp.square((grid_V - mu) / jnp.exp(log_sigma))


def bimodal_logp(grid_V: jax.Array, centers: Sequence[float] = (-2.0, 2.0),
                 width: float = 0.5, weights: Sequence[float] = (0.5, 0.5)) -> jax.Array:
    """Log-probs over `grid_V` of a mixture of discretized Gaussians (one per center).

    Example: `jnp.exp(bimodal_logp(jnp.linspace(-4, 4, 81))).sum()` is 1.
    """
    if len(centers) != len(weights):
        raise ValueError(f"{len(centers)} centers but {len(weights)} weights")
    w = jnp.asarray(weights, jnp.float32)
    if not bool(jnp.all(w > 0)):
        raise ValueError(f"weights must be positive, got {tuple(weights)}")
    comp_KxV = jnp.stack([jax.nn.log_softmax(gaussian_logits(grid_V, c, jnp.log(width)))
                          for c in centers])
    return jax.nn.logsumexp(comp_KxV + jnp.log(w / w.sum())[:, None], axis=0)


def divergence(direction: str) -> Callable:
    """The package loss of one KL direction: `reverse_kl_loss` or `forward_kl_loss`."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}, expected one of {DIRECTIONS}")
    return losses.reverse_kl_loss if direction == "reverse" else losses.forward_kl_loss


@functools.partial(jax.jit, static_argnames=("direction", "steps"))
def fit_unimodal(target_logp_V: jax.Array, grid_V: jax.Array, direction: str, *,
                 mu0: float = 0.3, log_sigma0: float = 0.0, steps: int = 300,
                 lr: float = 0.05) -> dict[str, jax.Array]:
    """Fit one discretized Gaussian (mu, log sigma) to a target by Adam on a KL direction.

    "reverse" minimizes KL(student || target) (`reverse_kl_loss`, mode seeking); "forward"
    minimizes KL(target || student) (`forward_kl_loss`, mass covering). Returns the final
    "mu", "sigma", the fitted "logp_V" and the per-step "loss_S".
    """
    loss_fn = divergence(direction)
    target_1x1xV = target_logp_V[None, None]
    mask_1x1 = jnp.ones((1, 1), jnp.float32)

    def loss(params):
        logits_1x1xV = gaussian_logits(grid_V, params["mu"], params["log_sigma"])[None, None]
        return loss_fn(logits_1x1xV, target_1x1xV, mask_1x1)[0]

    tx = optax.adam(lr)
    params = {"mu": jnp.float32(mu0), "log_sigma": jnp.float32(log_sigma0)}

    def step(carry, _):
        params, opt_state = carry
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    (params, _), loss_S = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
    logp_V = jax.nn.log_softmax(gaussian_logits(grid_V, params["mu"], params["log_sigma"]))
    return {"mu": params["mu"], "sigma": jnp.exp(params["log_sigma"]), "logp_V": logp_V,
            "loss_S": loss_S}


# ----------------------------------------------------------------------------------------
# 01: the sampled-token (Kimi) signal against the full-vocabulary gradient
# ----------------------------------------------------------------------------------------

def full_vocab_gradient(student_logits_V: jax.Array, teacher_logits_V: jax.Array) -> jax.Array:
    """d KL(p || q) / d student logits at one position, via `reverse_kl_loss` (exact)."""
    mask_1x1 = jnp.ones((1, 1), jnp.float32)
    return jax.grad(lambda s_V: losses.reverse_kl_loss(
        s_V[None, None], teacher_logits_V[None, None], mask_1x1)[0])(student_logits_V)


def sampled_token_gradient(student_logits_V: jax.Array, teacher_logits_V: jax.Array,
                           tokens_N: jax.Array, r_max: float) -> jax.Array:
    """d `kimi_mopd_loss` / d student logits from N tokens sampled at one position.

    Each token is one row of a [1, N] batch with the same student and teacher logits, so
    the token-mean loss -1/N sum_n r_n lp(y_n) is the N-sample estimate of the reverse-KL
    gradient (unbiased when no log-ratio is clipped by r_max).
    """
    n, v = tokens_N.shape[0], student_logits_V.shape[0]
    t_1xNxV = jnp.broadcast_to(teacher_logits_V, (1, n, v))
    mask_1xN = jnp.ones((1, n), jnp.float32)

    def loss(s_V):
        lp_1xN = losses.token_logprobs(jnp.broadcast_to(s_V, (1, n, v)), tokens_N[None])
        lt_1xN = losses.token_logprobs(t_1xNxV, tokens_N[None])
        return losses.kimi_mopd_loss(lp_1xN, lt_1xN, mask_1xN, r_max=r_max)[0]

    return jax.grad(loss)(student_logits_V)


def sampled_gradient_errors(student_logits_V: jax.Array, teacher_logits_V: jax.Array,
                            sample_counts: Sequence[int], *, r_max: float, repeats: int = 64,
                            seed: int = 0) -> dict[str, np.ndarray]:
    """Cosine and relative error of the N-sample Kimi gradient against the exact one.

    Each of `repeats` runs draws max(sample_counts) tokens from the student
    p = softmax(student_logits_V) and takes the gradient of `kimi_mopd_loss` on each token
    alone; the N-sample estimate is the mean of the first N (what the token-mean loss over
    N tokens gives). Returns "cosine" and "rel_err" (||g_N - g|| / ||g||), each
    [len(sample_counts), repeats], and the exact "full_grad_V".
    """
    counts = np.asarray(sample_counts, np.int64)
    if counts.ndim != 1 or counts.size == 0 or counts.min() < 1:
        raise ValueError(f"sample_counts={sample_counts!r}: expected positive ints")
    full_V = full_vocab_gradient(student_logits_V, teacher_logits_V)

    @jax.jit
    def run(key):
        y_M = jax.random.categorical(key, student_logits_V, shape=(int(counts.max()),))
        g_MxV = jax.vmap(lambda y: sampled_token_gradient(student_logits_V, teacher_logits_V,
                                                          y[None], r_max))(y_M)
        g_CxV = jnp.cumsum(g_MxV, axis=0)[counts - 1] / counts[:, None]
        norm_C = jnp.linalg.norm(g_CxV, axis=-1)
        cos_C = g_CxV @ full_V / jnp.maximum(norm_C * jnp.linalg.norm(full_V), 1e-30)
        return cos_C, jnp.linalg.norm(g_CxV - full_V, axis=-1) / jnp.linalg.norm(full_V)

    cos_RxC, err_RxC = jax.vmap(run)(jax.random.split(jax.random.key(seed), repeats))
    return {"cosine": np.asarray(cos_RxC).T, "rel_err": np.asarray(err_RxC).T,
            "full_grad_V": np.asarray(full_V)}


# ----------------------------------------------------------------------------------------
# 01: what IcePop masks as the train/inference mismatch grows
# ----------------------------------------------------------------------------------------

def icepop_mismatch(noise_scale: float, *, bounds: tuple[float, float] = (0.5, 5.0),
                    batch: int = 64, tokens: int = 32, vocab: int = 64,
                    logit_scale: float = 3.0, seed: int = 0) -> dict:
    """`grpo_loss(correction="icepop")` on a toy batch whose sampler sees perturbed logits.

    The training engine's logits are s ~ logit_scale * N(0, 1) per token; the inference
    engine samples from s + noise_scale * N(0, 1) (a stand-in for kernel/precision
    differences). Tokens are drawn from the sampler, as in a real rollout, and IcePop keeps
    a token when k = p_train(y) / p_sampler(y) lies in `bounds`. Returns the loss metrics
    (incl. "icepop_masked_frac", "mismatch_mean") and "log_k_BxT".
    """
    k_train, k_noise, k_sample, k_adv = jax.random.split(jax.random.key(seed), 4)
    train_BxTxV = logit_scale * jax.random.normal(k_train, (batch, tokens, vocab))
    sampler_BxTxV = train_BxTxV + noise_scale * jax.random.normal(k_noise, train_BxTxV.shape)
    y_BxT = jax.random.categorical(k_sample, sampler_BxTxV)
    old_BxT = losses.token_logprobs(train_BxTxV, y_BxT)
    sampler_logp_BxT = losses.token_logprobs(sampler_BxTxV, y_BxT)
    adv_B = jnp.where(jax.random.bernoulli(k_adv, 0.5, (batch,)), 1.0, -1.0)
    mask_BxT = jnp.ones((batch, tokens), jnp.float32)
    _, metrics = losses.grpo_loss(old_BxT, old_BxT, adv_B, mask_BxT,
                                  sampler_logp_BxT=sampler_logp_BxT, correction=losses.Correction(
                                      "icepop", icepop_bounds=bounds))
    out = {k: float(v) for k, v in metrics.items()}
    out["log_k_BxT"] = np.asarray(old_BxT - sampler_logp_BxT)
    return out


def icepop_sweep(noise_scales: Sequence[float], bounds: tuple[float, float] = (0.5, 5.0),
                 **kwargs) -> np.ndarray:
    """IcePop's masked-token fraction for each mismatch noise scale (see `icepop_mismatch`)."""
    return np.asarray([icepop_mismatch(s, bounds=bounds, **kwargs)["icepop_masked_frac"]
                       for s in noise_scales])


# ----------------------------------------------------------------------------------------
# 02: compiled temporary memory of the fused kernels against the full-logits reference
# ----------------------------------------------------------------------------------------

def kernel_value_and_grad(kind: str, implementation: str, *, chunk_v: int = 1024,
                          r_max: float = 5.0) -> Callable:
    """jit(value_and_grad) wrt (h_s, w_s) of a scalar loss built on one fused op.

    kind "reverse_kl": mean_n KL_n from `fused_reverse_kl`; kind "clipped_log_ratio":
    -mean_n r_n lp_s,n from `fused_clipped_log_ratio` (the Kimi form). Arguments of the
    returned function: (h_s_NxD, w_s_DxV, h_t_NxE, w_t_ExV, targets_N).
    """
    if kind == "reverse_kl":
        def loss(h_s, w_s, h_t, w_t, y):
            return jnp.mean(fused_reverse_kl(h_s, w_s, h_t, w_t, implementation=implementation,
                                             chunk_v=chunk_v))
    elif kind == "clipped_log_ratio":
        def loss(h_s, w_s, h_t, w_t, y):
            lp_s, _, r = fused_clipped_log_ratio(h_s, w_s, h_t, w_t, y, r_max=r_max,
                                                 implementation=implementation, chunk_v=chunk_v)
            return -jnp.mean(r * lp_s)
    else:
        raise ValueError(f"kind={kind!r}, expected 'reverse_kl' or 'clipped_log_ratio'")
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def kernel_inputs(n: int, d: int, v: int, *, seed: int = 0, scale: float = 0.05) -> tuple:
    """Random (h_s_NxD, w_s_DxV, h_t_NxD, w_t_DxV, targets_N), fp32, as in benchmarks/."""
    ks = jax.random.split(jax.random.key(seed), 5)
    return (jax.random.normal(ks[0], (n, d)), jax.random.normal(ks[1], (d, v)) * scale,
            jax.random.normal(ks[2], (n, d)), jax.random.normal(ks[3], (d, v)) * scale,
            jax.random.randint(ks[4], (n,), 0, v))


def compiled_temp_bytes(fn: Callable, *args) -> int:
    """Peak temporary buffer size XLA plans for `fn(*args)`, from the compiled executable
    (``jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes``)."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return int(jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def kernel_memory_sweep(kind: str, sizes: Sequence[tuple[int, int]], *, d: int = 64,
                        implementations: Sequence[str] = ("reference", "xla"),
                        chunk_v: int = 1024) -> list[dict]:
    """Temporary bytes of value-and-grad for each (N tokens, V vocab) and implementation.

    Returns rows {"kind", "implementation", "n", "v", "temp_bytes"}; only compiles, never runs.
    """
    rows = []
    for n, v in sizes:
        args = kernel_inputs(n, d, v)
        for impl in implementations:
            fn = kernel_value_and_grad(kind, impl, chunk_v=chunk_v)
            rows.append({"kind": kind, "implementation": impl, "n": n, "v": v,
                         "temp_bytes": compiled_temp_bytes(fn, *args)})
    return rows


# ----------------------------------------------------------------------------------------
# 03: training histories
# ----------------------------------------------------------------------------------------

def history_series(history: Sequence[Mapping[str, float]], key: str) -> np.ndarray:
    """`key` per iteration of a `train_policy` history; NaN where an iteration lacks it."""
    return np.asarray([float(h.get(key, np.nan)) for h in history], np.float64)


def running_mean(x_N: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` finite values up to each index (NaN-aware).

    Example: `running_mean(np.array([1., np.nan, 3.]), 2)` is `[1., 1., 3.]`.
    """
    if window < 1:
        raise ValueError(f"window={window}, expected >= 1")
    x_N = np.asarray(x_N, np.float64)
    out_N = np.full_like(x_N, np.nan)
    for i in range(len(x_N)):
        seen = x_N[max(0, i - window + 1):i + 1]
        seen = seen[np.isfinite(seen)]
        if seen.size:
            out_N[i] = seen.mean()
    return out_N
