"""One process of the multi-host `train_policy` test, and the run it shares with the reference.

    python multihost_policy_child.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Starts `opd_jax.distributed` (gloo, 4 CPU devices per process), then `run()`: the real
driver on a DeepSeek full-vocabulary OPD config with two teachers (an HF folder and an
opd_jax/Orbax run, written to OUT_DIR by the test) on a (data=2, fsdp=2, tensor=2) mesh
whose data axis spans the processes: 2 iterations with a checkpoint after each, then the
same workdir again with `train.steps` raised to 3 (a resume). Each process writes
OUT_DIR/child<i>.json: how its teachers were placed and how often the vocab-parallel kernel
was traced. The test runs `run()` in one process on 8 devices and compares the final
checkpoints' parameters and the metrics.

Nothing here may touch a JAX backend at import time: `initialize()` must come first.
"""
from __future__ import annotations

import json
import os
import sys

MESH_SHAPE = (2, 2, 2)       # data=2 spans the two processes; fsdp and tensor within each
LOCAL_DEVICES = 4
STEPS, RESUMED_STEPS = 2, 3
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def teacher_paths(out_dir: str) -> dict[str, str]:
    return {"general/high": os.path.join(out_dir, "teacher_hf"),
            "general/max": os.path.join(out_dir, "teacher_run")}


def write_teachers(out_dir: str) -> dict[str, str]:
    """An HF teacher (E=48, untied) and an opd_jax run's Orbax checkpoint (E=32, tied),
    both random, sharing the synthetic tokenizer's 128-token vocabulary."""
    import ml_collections

    from opd_jax.checkpoint import Checkpointer
    from opd_jax.models import ModelConfig, save_pretrained, synthetic_tokenizer
    from opd_jax.models import tokenizer_meta
    from opd_jax.trainers.state import create_state, make_optimizer
    from tests.models.helpers import random_model

    paths = teacher_paths(out_dir)
    hf = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=False)
    save_pretrained(random_model(hf, seed=1), paths["general/high"])
    run = hf.replace(hidden_size=32, tie_embeddings=True)
    tx = make_optimizer(ml_collections.ConfigDict(dict(
        name="sgd", lr=1e-2, schedule="constant", warmup_steps=0, grad_clip=0.0)), 1)
    _, state = create_state(random_model(run, seed=2), tx)
    ckpt = Checkpointer(os.path.join(paths["general/max"], "checkpoints"), async_save=False)
    ckpt.save(1, state, None, {"model": run.to_dict(),
                               "tokenizer": tokenizer_meta("synthetic", synthetic_tokenizer())})
    ckpt.close()
    return paths


def config(out_dir: str, steps: int):
    """configs/opd.py:deepseek_full_vocab at the smallest size: 8 episodes per iteration
    in two cells (general/high, general/max), each routed to its teacher."""
    from opd_jax.config import load_config
    paths = teacher_paths(out_dir)
    return load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:deepseek_full_vocab"), [
        "--config.model.hidden_size=32", "--config.model.intermediate_size=64",
        "--config.model.num_layers=1", "--config.model.head_dim=8",
        "--config.rollout.prompts_per_step=8", "--config.rollout.sampling.max_new_tokens=8",
        "--config.rollout.sampling.max_turns=2", "--config.rollout.wal_every=0",
        "--config.eval.n=4", "--config.eval.sampling.max_new_tokens=8",
        "--config.tasks.efforts=('high', 'max')", "--config.teachers.routing=cell",
        f"--config.teachers.paths={paths!r}", "--config.objective.options.implementation=xla",
        f"--config.mesh.shape={MESH_SHAPE!r}", "--config.optim.lr=1e-2",
        "--config.train.ckpt_every=1", f"--config.train.steps={steps}"])


def run(out_dir: str, workdir: str) -> dict:
    """2 iterations, then resumed to 3; returns what the placement spies saw."""
    import jax
    from flax import nnx

    from opd_jax.distributed import barrier
    from opd_jax.models import ModelRef
    from opd_jax.trainers.run_policy import train_policy
    from pallas_kernels import sharded

    seen = {"sharded_kernel_traces": 0, "teachers": {}}
    kernel, load = sharded.fused_sharded, ModelRef.load

    def kernel_spy(*args):
        seen["sharded_kernel_traces"] += 1
        layout = args[-1]
        seen["layout"] = [layout.vocab_axis, list(layout.token_axis)]
        return kernel(*args)

    def load_spy(spec, mesh=None, rules=None):
        model = load(spec, mesh, rules)
        leaves = jax.tree.leaves(nnx.state(model))
        seen["teachers"][os.path.basename(spec.path)] = {
            "kind": spec.kind,
            "mesh": None if mesh is None else list(mesh.devices.shape),
            "all_on_mesh": all(getattr(x.sharding, "mesh", None) == mesh for x in leaves),
            "fully_addressable": all(x.is_fully_addressable for x in leaves),
            "specs": sorted({str(x.sharding.spec) for x in leaves})}
        return model

    sharded.fused_sharded, ModelRef.load = kernel_spy, load_spy
    try:
        first = train_policy(config(out_dir, STEPS), workdir, progress=False)
        barrier("multihost_policy_first_run")
        resumed = train_policy(config(out_dir, RESUMED_STEPS), workdir, progress=False)
    finally:
        sharded.fused_sharded, ModelRef.load = kernel, load
    seen["history_steps"] = [[h["step"] for h in first["history"]],
                             [h["step"] for h in resumed["history"]]]
    return seen


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    from opd_jax import distributed
    assert distributed.initialize(f"localhost:{port}", num_processes, process_id,
                                  local_device_count=LOCAL_DEVICES, timeout_s=60)
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")    # as tests/conftest.py
    assert jax.process_count() == num_processes
    seen = run(out_dir, os.path.join(out_dir, "multi"))
    with open(os.path.join(out_dir, f"child{process_id}.json"), "w") as f:
        json.dump(seen, f)
    distributed.barrier("multihost_policy_child_done")
    print(f"process {process_id}: ok", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
