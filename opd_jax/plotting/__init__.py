"""Every plot of the project, and the toy experiments behind the notebooks.

* :mod:`opd_jax.plotting.toys`: the notebooks' toy experiments (pure JAX/numpy, arrays out);
* :mod:`opd_jax.plotting.figures`: the notebooks' figures (``plot_*`` -> matplotlib Figure);
* :mod:`opd_jax.plotting.recipes`: the recipes' result PNGs (``plot_curves``, ``plot_bars``,
  ``plot_seed_lines``; Agg backend, files only), used by ``opd_jax.recipes.report`` and the
  recipes' ``report`` functions.

matplotlib is imported inside the plotting functions only. ``from opd_jax import plotting``
gives every name of toys and figures (``plotting.bimodal_logp``, ``plotting.plot_icepop``).

    grid_V = jnp.linspace(-4, 4, 81)
    target_logp_V = bimodal_logp(grid_V)
    fit = fit_unimodal(target_logp_V, grid_V, "reverse")      # sits on one mode
    fig = plot_mode_seeking(grid_V, target_logp_V, {"reverse KL": fit["logp_V"]})
"""
from opd_jax.plotting.figures import *  # noqa: F401,F403
from opd_jax.plotting.figures import _plt  # noqa: F401
from opd_jax.plotting.recipes import plot_bars, plot_curves, plot_seed_lines  # noqa: F401
from opd_jax.plotting.toys import *  # noqa: F401,F403
