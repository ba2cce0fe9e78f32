"""The toy experiments and plots of opd_jax.plotting, checked against closed forms."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opd_jax import plotting

GRID_V = jnp.linspace(-6.0, 6.0, 121)


def test_bimodal_logp_is_normalized_with_modes_at_centers():
    logp_V = plotting.bimodal_logp(GRID_V, centers=(-2.0, 2.0), width=0.5)
    np.testing.assert_allclose(float(jnp.exp(logp_V).sum()), 1.0, rtol=1e-5)
    peaks = np.sort(np.asarray(GRID_V)[np.argsort(np.asarray(logp_V))[-2:]])
    np.testing.assert_allclose(peaks, [-2.0, 2.0], atol=1e-5)
    with pytest.raises(ValueError, match="2 centers but 1 weights"):
        plotting.bimodal_logp(GRID_V, centers=(-2.0, 2.0), weights=(1.0,))
    with pytest.raises(ValueError, match="weights must be positive"):
        plotting.bimodal_logp(GRID_V, weights=(1.0, 0.0))


def test_reverse_kl_seeks_a_mode_forward_kl_matches_moments():
    target_logp_V = plotting.bimodal_logp(GRID_V)
    rev = plotting.fit_unimodal(target_logp_V, GRID_V, "reverse", mu0=1.0)
    assert abs(float(rev["mu"]) - 2.0) < 1e-2 and abs(float(rev["sigma"]) - 0.5) < 1e-2
    np.testing.assert_allclose(float(rev["loss_S"][-1]), np.log(2.0), atol=1e-3)
    fwd = plotting.fit_unimodal(target_logp_V, GRID_V, "forward", mu0=1.0)
    # A Gaussian on the grid is an exponential family in (x, x^2): the forward-KL optimum
    # matches the target's mean and second moment on the grid.
    p_V, q_V, x_V = jnp.exp(fwd["logp_V"]), jnp.exp(target_logp_V), GRID_V
    np.testing.assert_allclose(float(p_V @ x_V), float(q_V @ x_V), atol=1e-3)
    np.testing.assert_allclose(float(p_V @ x_V ** 2), float(q_V @ x_V ** 2), rtol=1e-3)
    with pytest.raises(ValueError, match="direction="):
        plotting.divergence("jsd")


def _student_teacher(v=12, seed=0):
    k_s, k_t = jax.random.split(jax.random.key(seed))
    s_V = jax.random.normal(k_s, (v,))
    return s_V, s_V + 1.5 * jax.random.normal(k_t, (v,))


def test_full_vocab_gradient_closed_form():
    s_V, t_V = _student_teacher()
    logp_V, logq_V = jax.nn.log_softmax(s_V), jax.nn.log_softmax(t_V)
    p_V = jnp.exp(logp_V)
    kl = p_V @ (logp_V - logq_V)
    np.testing.assert_allclose(plotting.full_vocab_gradient(s_V, t_V),
                               p_V * (logp_V - logq_V - kl), atol=1e-6)


def test_sampled_token_gradient_is_unbiased_when_unclipped_and_biased_when_clipped():
    s_V, t_V = _student_teacher()
    p_V = jax.nn.softmax(s_V)
    every_V = jnp.arange(s_V.shape[0])

    def expected(r_max):
        """E_{y ~ p}[gradient from the single token y], summed exactly over the vocabulary."""
        g_VxV = jax.vmap(
            lambda y: plotting.sampled_token_gradient(s_V, t_V, y[None], r_max))(every_V)
        return p_V @ g_VxV
    full_V = plotting.full_vocab_gradient(s_V, t_V)
    np.testing.assert_allclose(expected(1e9), full_V, atol=1e-6)
    assert float(jnp.max(jnp.abs(expected(0.1) - full_V))) > 1e-2


def test_sampled_gradient_errors_shapes_and_convergence():
    s_V, t_V = _student_teacher()
    counts = [1, 16, 1024]
    res = plotting.sampled_gradient_errors(s_V, t_V, counts, r_max=1e9, repeats=8)
    assert res["cosine"].shape == (3, 8) and res["rel_err"].shape == (3, 8)
    assert np.all(np.abs(res["cosine"]) <= 1 + 1e-5)
    assert np.median(res["rel_err"][-1]) < 0.2 < np.median(res["rel_err"][0])
    with pytest.raises(ValueError, match="positive ints"):
        plotting.sampled_gradient_errors(s_V, t_V, [0, 4], r_max=1.0)


def test_icepop_masks_nothing_without_mismatch_and_more_with_it():
    clean = plotting.icepop_mismatch(0.0, batch=8, tokens=8)
    assert clean["icepop_masked_frac"] == 0.0
    np.testing.assert_allclose(clean["mismatch_mean"], 1.0, atol=1e-6)
    assert clean["log_k_BxT"].shape == (8, 8)
    frac = plotting.icepop_sweep([0.5, 3.0], batch=8, tokens=8)
    assert frac[1] > max(frac[0], 0.3)
    tight = plotting.icepop_sweep([0.5], bounds=(0.8, 1.25), batch=8, tokens=8)
    assert tight[0] > frac[0]


def test_kernel_memory_reference_grows_with_vocab_xla_does_not():
    rows = plotting.kernel_memory_sweep("reverse_kl", [(32, 2048), (32, 8192)], d=16,
                                        chunk_v=512)
    by = {(r["implementation"], r["v"]): r["temp_bytes"] for r in rows}
    assert by[("reference", 8192)] > 3 * by[("reference", 2048)]
    assert by[("xla", 8192)] < 1.5 * by[("xla", 2048)]
    assert by[("xla", 8192)] < by[("reference", 8192)] / 4
    with pytest.raises(ValueError, match="kind="):
        plotting.kernel_value_and_grad("forward_kl", "xla")


def test_kernel_value_and_grad_matches_reference():
    args = plotting.kernel_inputs(16, 8, 300, scale=0.3)
    for kind in ("reverse_kl", "clipped_log_ratio"):
        v_ref, g_ref = plotting.kernel_value_and_grad(kind, "reference")(*args)
        v, g = plotting.kernel_value_and_grad(kind, "xla", chunk_v=128)(*args)
        np.testing.assert_allclose(v, v_ref, rtol=1e-5)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_history_series_and_running_mean():
    history = [{"reward/a": 1.0}, {}, {"reward/a": 3.0}]
    x_N = plotting.history_series(history, "reward/a")
    np.testing.assert_array_equal(np.isnan(x_N), [False, True, False])
    np.testing.assert_allclose(plotting.running_mean(x_N, 2), [1.0, 1.0, 3.0])
    np.testing.assert_allclose(plotting.running_mean(x_N, 3), [1.0, 1.0, 2.0])
    assert np.isnan(plotting.running_mean(np.array([np.nan]), 2)[0])
    with pytest.raises(ValueError, match="window"):
        plotting.running_mean(x_N, 0)


def test_plots_return_figures():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    logp_V = plotting.bimodal_logp(GRID_V)
    history = [{"reward/a/high": 0.1 * i, "teacher/a/high/kl": 1.0 / (i + 1)} for i in range(5)]
    rows = [{"kind": "reverse_kl", "implementation": impl, "n": 8, "v": v, "temp_bytes": b}
            for impl, b in (("reference", 4096), ("xla", 1024)) for v in (256, 1024)]
    figs = [
        plotting.plot_mode_seeking(GRID_V, logp_V, {"fit": logp_V}, {"fit": {"ls": "--"}}),
        plotting.plot_estimator_convergence([1, 2], {"x": {"cosine": np.ones((2, 3)),
                                                           "rel_err": np.ones((2, 3))}}),
        plotting.plot_icepop([0.1, 1.0], {"b": np.array([0.0, 0.5])}, log_k=np.zeros((2, 2))),
        plotting.plot_kernel_memory({"v": rows}),
        plotting.plot_cell_rewards(history, ["a/high"], teacher={"a/high": 0.9},
                                   start={"a/high": 0.1}),
        plotting.plot_teacher_signal(history, ["a/high"], "kl"),
    ]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    with pytest.raises(ValueError, match="sweep key"):
        plotting.plot_kernel_memory({"d": rows})
    plt.close("all")
