"""Multi-process JAX (TPU pods, GPU nodes, local CPU processes): start-up and host reads.

One Python process runs per host (TPU VM / GPU node; or several local CPU processes for
tests). Every process runs the *same program* with the same config and seed; a mesh then
spans all processes' devices (`jax.devices()` is global, `jax.local_devices()` is this
process's), and jitted steps run SPMD across them.

Call :func:`initialize` first thing, before anything touches a JAX backend::

    from opd_jax import distributed
    distributed.initialize()            # reads OPD_JAX_* env vars; no-op if none are set

Configuration (arguments win over environment variables):

=============================  ======================================================
``OPD_JAX_COORDINATOR``        ``host:port`` of process 0 (reachable from every process)
``OPD_JAX_NUM_PROCESSES``      number of processes
``OPD_JAX_PROCESS_ID``         this process's id, 0 .. n-1
``OPD_JAX_LOCAL_DEVICE_COUNT`` CPU only: fake CPU devices in this process
``OPD_JAX_DISTRIBUTED=auto``   call ``jax.distributed.initialize()`` with no arguments: JAX
                               detects the cluster itself (Cloud TPU pods, SLURM, Open MPI)
=============================  ======================================================

On CPU the cross-process collectives are gloo (``jax_cpu_collectives_implementation``).

Reading arrays back: a global array sharded across processes cannot be fetched with
``np.asarray`` / ``jax.device_get`` (each process holds only its shards). :func:`fetch`
returns host numpy values for any pytree, gathering such leaves across processes; it is a
collective, so every process must call it with the same tree.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

log = logging.getLogger(__name__)

ENV_COORDINATOR = "OPD_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "OPD_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "OPD_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "OPD_JAX_LOCAL_DEVICE_COUNT"
ENV_AUTO = "OPD_JAX_DISTRIBUTED"


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected an integer") from None


def _set_flag(name: str, value) -> None:
    try:
        jax.config.update(name, value)
    except Exception as e:  # a flag that moved or is validated (backend already up)
        raise RuntimeError(f"cannot set jax config {name}={value!r} ({e}); "
                           "opd_jax.distributed.initialize() must run before any JAX "
                           "computation or jax.devices() call") from e


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None, *,
               auto: bool | None = None, timeout_s: int = 300) -> bool:
    """Start (or join) the JAX distributed runtime; returns True when multi-process.

    * Nothing configured (no arguments, no ``OPD_JAX_*`` variables), or one process: no-op
      (apart from `local_device_count`), returns False.
    * `coordinator_address` + `num_processes` + `process_id`: explicit start (GPU nodes,
      local CPU processes). `local_device_count` (CPU) sets ``jax_num_cpu_devices``; on CPU
      collectives use gloo.
    * `auto` (or ``OPD_JAX_DISTRIBUTED=auto``): ``jax.distributed.initialize()`` with no
      arguments; JAX reads the cluster (TPU pod metadata, SLURM, Open MPI).

    Idempotent: a second call (with any arguments) returns the current state. Must run
    before anything initialises a JAX backend. `timeout_s` bounds the wait for all
    processes to connect.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if local_device_count is None:
        local_device_count = _env_int(ENV_LOCAL_DEVICE_COUNT)
    if auto is None:
        auto = os.environ.get(ENV_AUTO, "").strip().lower() in ("auto", "1", "true")

    if local_device_count is not None:
        if local_device_count < 1:
            raise ValueError(f"local_device_count={local_device_count}: expected >= 1")
        _set_flag("jax_num_cpu_devices", int(local_device_count))

    explicit = coordinator_address is not None or (num_processes or 1) > 1
    if not auto and not explicit:
        return False
    if explicit:
        missing = [n for n, v in (("coordinator_address", coordinator_address),
                                  ("num_processes", num_processes),
                                  ("process_id", process_id)) if v is None]
        if missing:
            raise ValueError(f"multi-process start needs {', '.join(missing)} (arguments or "
                             f"{ENV_COORDINATOR} / {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} not in [0, {num_processes})")
        if num_processes == 1:
            return False
    # Gloo collectives between CPU processes (harmless on TPU/GPU: CPU client only).
    _set_flag("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        log.info("jax.distributed: process %d/%d, coordinator %s", process_id, num_processes,
                 coordinator_address)
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(initialization_timeout=timeout_s)
    return jax.process_count() > 1


def is_main_process() -> bool:
    """True on process 0: the one that writes files (config, metrics, reports)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op single-process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def settle(x: Any) -> Any:
    """`x`, waited for when several processes share a mesh (else returned as is).

    With CPU (gloo) collectives, different multi-device programs in flight at once can
    deadlock: 60 small checksum programs on a 2-process (2, 2, 2) mesh hung one process in a
    digest while the other waited in Orbax's save barrier. Multi-process callers that launch
    several programs back to back (checkpoint digests, teacher scoring) settle each one."""
    return jax.block_until_ready(x) if jax.process_count() > 1 else x


def fetch(tree: Any) -> Any:
    """Host numpy values of a pytree of arrays, on every process.

    Leaves this process can read whole (process-local, fully replicated, e.g. step metrics
    with replicated out_shardings) are copied; leaves sharded across processes (params on
    an fsdp axis spanning hosts, a batch-sharded array) are all-gathered
    (`multihost_utils.process_allgather`). Collective: all processes must call it with the
    same tree, in the same order.
    """
    def one(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(one, tree)
