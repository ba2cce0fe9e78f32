"""Orbax checkpoints of train state + data iterator + JSON metadata, saved together.

Each step is a directory ``<workdir>/checkpoints/<step>/{state,data,meta}`` written by Orbax
to a temporary name and renamed when complete, so a run killed mid-save leaves the previous
checkpoint intact and the partial one is ignored. Resume order (big_vision's): the run's own
workdir first, then an explicit init checkpoint, then scratch.
"""
from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save/restore ``(state, data iterator, meta)`` under ``directory``.

    Args:
      directory: where step folders go (created on the first save, not before).
      keep: how many recent checkpoints to keep.
      async_save: write in a background thread; `wait()` (or `close()`) blocks until done.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self._mngr = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "data", "meta"),
            item_handlers={"data": grain.checkpoint.CheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=False, enable_async_checkpointing=async_save),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state: Any, data_iter: Any | None, meta: dict) -> None:
        os.makedirs(self.directory, exist_ok=True)
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self._mngr.save(step, args=ocp.args.Composite(**args), force=True)

    def read_meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory!r}")
        return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int | None, abstract_state: Any, data_iter: Any | None = None
                ) -> tuple[Any, dict]:
        """Restore into the shapes/shardings of `abstract_state`; `data_iter` in place."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory!r}")
        args = {"state": ocp.args.StandardRestore(abstract_state),
                "meta": ocp.args.JsonRestore()}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self._mngr.restore(step, args=ocp.args.Composite(**args))
        return out["state"], out["meta"]

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree of arrays, for `restore`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def latest_step_dir(path: str | os.PathLike) -> str:
    """Resolve a run workdir, its ``checkpoints/`` folder, or a step folder to a step folder."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(os.path.join(path, "state")):
        return path
    ckdir = os.path.join(path, "checkpoints") if os.path.isdir(
        os.path.join(path, "checkpoints")) else path
    steps = sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) if os.path.isdir(ckdir) else []
    if not steps:
        raise FileNotFoundError(f"no Orbax checkpoint under {path!r} (expected a run workdir, "
                                f"its checkpoints/ folder, or a step folder)")
    return os.path.join(ckdir, str(steps[-1]))


def read_step_meta(step_dir: str) -> dict:
    import json
    with open(os.path.join(step_dir, "meta", "metadata"), encoding="utf-8") as f:
        return json.load(f)


def restore_params(step_dir: str, abstract_params: Any, shardings: Any | None = None) -> Any:
    """Restore only ``params`` of a saved TrainState (no optimizer state is read)."""
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, abstract_params)
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), shardings)
    out = ocp.PyTreeCheckpointer().restore(
        os.path.join(step_dir, "state"),
        args=ocp.args.PyTreeRestore(item={"params": abstract_params},
                                    restore_args={"params": restore_args},
                                    partial_restore=True))
    return out["params"]
