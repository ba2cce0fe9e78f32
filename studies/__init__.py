"""One-off studies and their command lines, beside the library (not part of it).

Each measures something about the library or the testbed and writes a committed result;
none is imported by ``opd_jax``:

    python -m studies.base_model --workdir runs/base          # the built-in base model + card
    python -m studies.testbed --workdir runs/testbed          # does the testbed bind?
    python -m studies.speed_study --workdir runs/speed        # OPD against RL, in FLOPs
    python -m studies.student_sweep --workdir runs/k3 --seeds 0  # what moves the student?
    python -m studies.scale_estimate                          # real-size presets: memory
    python -m studies.smoke --out runs/smoke                  # real architectures, few layers

``scale_up`` holds the real-size presets the experiment configs apply (``apply_scale``),
``scale_estimate`` their shape checks and per-device memory estimate, ``scale_trace`` the
abstract shapes behind it.
"""
