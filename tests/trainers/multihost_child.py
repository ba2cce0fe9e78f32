"""One process of the multi-host parity test, and the steps it shares with the reference.

    python multihost_child.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Starts `opd_jax.distributed` (gloo, 4 CPU devices per process), then `run()`: on a mesh
spanning every process, a GRPO, a Kimi-MOPD (teacher log-probs) and a DeepSeek full-vocab
(teacher hidden states) policy step through `compile_step`, from the same seeded model and
the same global batch on every process, then sampling with rows sharded over the
mesh (`generate(mesh=)`). Process 0 writes the gathered parameters after
each stage (and the metrics) to OUT_DIR/params.npz. The test runs `run()` single-process on
8 devices and compares.

Nothing here may touch a JAX backend at import time: `initialize()` must come first.
"""
from __future__ import annotations

import functools
import os
import sys

import numpy as np

MESH_SHAPE = (2, 2, 2)       # data=2 spans the two processes; fsdp and tensor within each
LOCAL_DEVICES = 4
B, T = 8, 12


def _flat(prefix: str, params) -> dict[str, np.ndarray]:
    from flax import nnx
    return {prefix + "/" + "/".join(map(str, path)): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(params)}


def _batch() -> dict[str, np.ndarray]:
    """The global batch: every process builds the same one from a seed."""
    rng = np.random.default_rng(0)
    mask = (rng.random((B, T)) < 0.8).astype(np.int32)
    mask[:, :3] = 0                                      # "prompt" positions
    return {"inputs": rng.integers(0, 32, (B, T)).astype(np.int32),
            "targets": rng.integers(0, 32, (B, T)).astype(np.int32),
            "segment_ids": np.ones((B, T), np.int32),
            "mask": mask}


def run(mesh_shape=MESH_SHAPE) -> dict[str, np.ndarray]:
    """GRPO -> Kimi MOPD -> DeepSeek full-vocab steps -> sampling; params after each step,
    metrics and samples (host numpy)."""
    import jax
    import ml_collections
    from flax import nnx

    from opd_jax import sharding as sh
    from opd_jax.distributed import fetch
    from opd_jax.models import ModelConfig, Transformer
    from opd_jax.trainers.objectives import make_objective
    from opd_jax.teachers.scoring import teacher_outputs
    from opd_jax.trainers.policy import batch_logprobs, policy_step
    from opd_jax.trainers.state import compile_step, create_state, make_optimizer, place_state
    from tests.models.helpers import random_model

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)
    mesh = sh.make_mesh(mesh_shape)
    rep = sh.replicated(mesh)
    out: dict[str, np.ndarray] = {}

    # init_sharded (a jit with out_shardings) gives the same weights on any process layout.
    fresh = sh.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(1)), mesh)
    out |= _flat("init_sharded", fetch(nnx.state(fresh, nnx.Param)))

    tx = make_optimizer(ml_collections.ConfigDict(dict(
        name="adamw", lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01,
        schedule="constant", warmup_steps=0, min_lr_ratio=0.1, grad_clip=1.0)), 3)
    student = sh.shard_model(random_model(cfg, seed=0), mesh)     # host weights -> global
    graphdef, state = create_state(student, tx)
    state, shardings = place_state(state, mesh)
    out |= _flat("init", fetch(state.params))

    host = _batch()
    rng = np.random.default_rng(1)
    logp_fn = jax.jit(functools.partial(batch_logprobs, graphdef=graphdef))

    def step_fn(name, n_teachers=0, **options):
        return compile_step(functools.partial(policy_step, graphdef=graphdef, tx=tx,
                                              objective=make_objective(name, **options)),
                            shardings, mesh, extra_shardings=((rep,) * n_teachers,))

    def with_old_logp(batch_host):
        batch = sh.shard_batch(batch_host, mesh)
        seqs = {k: batch[k] for k in ("inputs", "targets", "segment_ids")}   # one compile
        batch["old_logp"] = logp_fn(state.params, state.rest, seqs)["logp"]
        return batch

    # 1. GRPO (IcePop against a perturbed sampler log-prob).
    batch = with_old_logp(host | {"adv": rng.standard_normal(B).astype(np.float32)})
    noise = sh.shard_batch(0.05 * rng.standard_normal((B, T)).astype(np.float32), mesh)
    batch["sampler_logp"] = batch["old_logp"] + noise
    state, m = step_fn("grpo")(state, batch, ())
    out |= _flat("grpo", fetch(state.params))
    out |= {f"metrics/grpo/{k}": v for k, v in fetch(m).items()}

    # Teachers: process-local models on every process (as the driver's TeacherBank loads
    # them), scored by a local jit; their outputs join the global batch.
    teachers = [random_model(cfg, seed=s) for s in (3, 4)]
    onehot = np.zeros((B, 2), np.float32)
    onehot[np.arange(B), rng.integers(0, 2, B)] = 1.0

    fns = {}

    def teacher_values(t, kind):
        g, p, r = nnx.split(t, nnx.Param, ...)
        if kind not in fns:                    # both teachers share a graphdef
            fns[kind] = jax.jit(functools.partial(teacher_outputs, graphdef=g, kind=kind))
        return np.asarray(fns[kind](p, r, host))

    # 2. Kimi MOPD on teacher log-probs (rows routed by `onehot`).
    tl = np.where(onehot[:, :1] > 0, teacher_values(teachers[0], "logp"),
                  teacher_values(teachers[1], "logp"))
    batch = with_old_logp(host | {"teacher_logp": tl, "teacher_onehot": onehot})
    batch["sampler_logp"] = batch["old_logp"]
    state, m = step_fn("kimi_mopd", r_max=2.0)(state, batch, ())
    out |= _flat("kimi_mopd", fetch(state.params))
    out |= {f"metrics/kimi_mopd/{k}": v for k, v in fetch(m).items()}

    # 3. DeepSeek full-vocab reverse KL on cached teacher hidden states + unembeddings.
    hidden = tuple(teacher_values(t, "hidden") * onehot[:, s, None, None]
                   for s, t in enumerate(teachers))
    batch = sh.shard_batch(host | {"teacher_hidden": hidden, "teacher_weights": onehot}, mesh)
    unembed = tuple(t.unembedding() for t in teachers)            # process-local arrays
    state, m = step_fn("deepseek_full_vocab", 2, implementation="xla")(state, batch, unembed)
    out |= _flat("deepseek_full_vocab", fetch(state.params))
    out |= {f"metrics/deepseek_full_vocab/{k}": v for k, v in fetch(m).items()}

    # 4. Sampling from the trained global params with rows and cache sharded on the mesh.
    from opd_jax.rollout import generate
    res = generate(nnx.merge(graphdef, state.params, state.rest),
                   [[1, 5, 9], [2, 7], [3, 3, 3, 4], [6]] * 2, max_new_tokens=6,
                   temperature=1.0, top_p=0.9, seed=3, max_len=32, mesh=mesh)
    out["generate/tokens"] = np.asarray(res.tokens)
    out["generate/logprobs"] = np.asarray(res.logprobs)
    return out


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    from opd_jax import distributed
    assert distributed.initialize(f"localhost:{port}", num_processes, process_id,
                                  local_device_count=LOCAL_DEVICES, timeout_s=60)
    assert distributed.initialize() is True                          # idempotent
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")    # as tests/conftest.py
    assert jax.process_count() == num_processes
    assert len(jax.local_devices()) == LOCAL_DEVICES
    assert len(jax.devices()) == LOCAL_DEVICES * num_processes
    out = run()
    if distributed.is_main_process():
        np.savez(os.path.join(out_dir, "params.npz"), **out)
    distributed.barrier("multihost_child_done")
    print(f"process {process_id}: ok", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
