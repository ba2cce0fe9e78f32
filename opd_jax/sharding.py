"""Meshes and logical-axis sharding: the only module that names mesh axes.

Models and configs speak in *logical* axes (`batch, seq, embed, mlp, heads, kv, head_dim,
vocab, ...`). A rule table (data in the config) maps each logical axis to zero or more mesh
axes (`data, fsdp, tensor`). Parameters carry their logical names in NNX metadata
(`sharding_names=`, stored as `out_sharding`) and are created with `eager_sharding=False`,
so a model is mesh-agnostic until `shard_model` / `init_sharded` places it.

Example::

    mesh = make_mesh((2, 4, 1))                     # data=2, fsdp=4, tensor=1
    model = init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    batch = shard_batch({"tokens": tokens_BxT}, mesh)

Multi-process (``jax.distributed``, see :mod:`opd_jax.distributed`): a mesh may span devices
of other processes. Every placement here goes through :func:`put`, which builds such a
global array from the *same* host value held by every process (`make_array_from_callback`:
each process copies only its own shards, no cross-process traffic); reading a global array
back is :func:`opd_jax.distributed.fetch`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Parameters: fully-sharded over fsdp, Megatron-style over tensor.
# Activations: batch over (data, fsdp). A rule maps to a mesh axis name, a tuple of names, or None.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("norm", None),
    ("layers", None),
)

Rules = Sequence[tuple[str, Any]]


def make_mesh(shape: Sequence[int] = (-1, 1, 1), axis_names: Sequence[str] = MESH_AXES,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all). One entry of `shape` may be -1 ("the rest").

    Axes are `Auto` (classic jit-with-shardings semantics), not the Explicit default of
    `jax.make_mesh` in this JAX version.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {tuple(shape)} has {len(shape)} axes, expected "
                         f"{len(axis_names)} for axis names {tuple(axis_names)}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {tuple(shape)}: at most one axis may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {tuple(shape)}: sizes must be positive or -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh shape {tuple(shape)}: {len(devices)} devices are not "
                             f"divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, "
                         f"have {len(devices)}")
    return jax.make_mesh(tuple(shape), tuple(axis_names),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=devices)


def logical_to_spec(logical: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES,
                    mesh: Mesh | None = None) -> P:
    """Map logical axis names to a PartitionSpec. A mesh axis is used at most once.

    Mesh axes of size 1, or absent from `mesh`, are dropped so specs stay minimal.
    """
    if logical is None:
        return P()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
        target = table[name]
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        keep = tuple(a for a in axes if a not in used
                     and (mesh is None or (a in mesh.shape and mesh.shape[a] > 1)))
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def _divisible_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drop mesh axes that do not divide the dimension (e.g. 2 kv heads on tensor=4)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        keep, size = [], 1
        for a in axes:
            if dim % (size * mesh.shape[a]) == 0:
                keep.append(a)
                size *= mesh.shape[a]
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return P(*out)


def named_sharding(logical: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                   rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """NamedSharding for an array of `shape` with logical axes `logical`."""
    return NamedSharding(mesh, _divisible_spec(logical_to_spec(logical, rules, mesh), shape, mesh))


def _logical_names(variable: nnx.Variable) -> tuple | None:
    meta = variable.get_metadata()
    return meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")


def state_shardings(state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """A pytree like `state` (an nnx.State, possibly abstract) of NamedShardings.

    Variables without logical names (scalars, RNG counters) are replicated.
    """
    def one(v):
        if isinstance(v, nnx.Variable):
            value = v.get_value() if hasattr(v, "get_value") else v.value
            return v.replace(named_sharding(_logical_names(v), np.shape(value), mesh, rules))
        return NamedSharding(mesh, P())
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_sharded(create: Callable[[], nnx.Module], mesh: Mesh,
                 rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Build a module directly into its shardings (no full copy on one device)."""
    abstract = nnx.eval_shape(create)
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh, rules)

    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nnx.state(create()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """`jax.device_put(x, sharding)` that also works when `sharding` spans other processes.

    * `sharding` fully addressable (single process, or a process-local mesh): device_put.
    * `x` already a global array (spans other processes): device_put reshards it on device.
    * otherwise `x` (numpy, or a process-local jax.Array) must hold the *same global value*
      on every process; each process fills only its own shards from it
      (`jax.make_array_from_callback`). The equality is the caller's contract and is not
      checked (device_put would check it with an all-gather of the whole value).
    """
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree: Any, shardings: Any) -> Any:
    """:func:`put` every leaf of `tree` with its sharding; `shardings` is a tree prefix of
    `tree` (as for `jax.device_put` / jit), e.g. from :func:`state_shardings`."""
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: put(x, s), sub), shardings, tree)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Place an existing module's variables on `mesh` by their logical names (in place).

    Multi-process: every process must hold the same weights (same seed or same checkpoint).
    """
    state = nnx.state(model)
    nnx.update(model, place(state, state_shardings(state, mesh, rules)))
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding for a [B, ...] batch array: B over the `batch` rule, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def batch_shards(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the `batch` logical axis is split on `mesh`."""
    return math.prod(mesh.shape[a] for a in _axes(logical_to_spec(("batch",), rules, mesh)[0]))


def shard_batch(batch: Mapping[str, Any] | Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Place every [B, ...] leaf of `batch` with its batch sharding (:func:`put`).

    Multi-process: pass the same *global* batch on every process (each keeps its rows).
    Raises if B does not divide over the batch mesh axes.
    """
    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        s = batch_sharding(mesh, x.ndim, rules)
        n = math.prod(mesh.shape[a] for a in _axes(s.spec[0])) if x.ndim else 1
        if x.ndim and x.shape[0] % n:
            raise ValueError(f"batch dimension {x.shape[0]} is not divisible by the {n} "
                             f"devices of mesh axes {_axes(s.spec[0])}")
        return put(x, s if x.ndim else NamedSharding(mesh, P()))
    return jax.tree.map(one, batch)


def vocab_parallel_axes(mesh: Mesh, rules: Rules = DEFAULT_RULES
                        ) -> tuple[str | tuple[str, ...] | None, str | tuple[str, ...] | None]:
    """(vocab mesh axes, token mesh axes) of a vocab-parallel computation on `mesh`.

    The vocabulary is split where the `vocab` logical axis is (default rules: "tensor"),
    tokens where `batch` is (default: ("data", "fsdp")); a mesh axis is used once (batch
    first) and axes of size 1 are dropped, so (None, ...) means the vocabulary is not
    split on this mesh.
    """
    spec = logical_to_spec(("batch", "vocab"), rules, mesh)
    return spec[1], spec[0]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@dataclasses.dataclass(frozen=True)
class Layout:
    """A run's device path in one object: its mesh and logical-axis rules. The train step,
    the old-log-prob forward, the teachers and the batch placement all read it, so none of
    them can disagree about where the batch (or any other) axis lives.

        layout = Layout(make_mesh((2, 4, 1)), rules)
        batch = layout.shard_batch(host_batch)          # once per iteration
        sub = layout.take_rows(batch, idx)              # a minibatch, gathered on device
    """
    mesh: Mesh
    rules: tuple = DEFAULT_RULES

    def __post_init__(self):   # hashable: rules from a config are (nested) lists
        freeze = lambda x: tuple(map(freeze, x)) if isinstance(x, (list, tuple)) else x  # noqa: E731
        object.__setattr__(self, "rules", freeze(self.rules))

    def batch(self, ndim: int = 2) -> NamedSharding:
        """A [B, ...] array's sharding: B over the `batch` rule, the rest replicated."""
        return batch_sharding(self.mesh, ndim, self.rules)

    @property
    def batch_shards(self) -> int:
        return batch_shards(self.mesh, self.rules)

    def replicated(self) -> NamedSharding:
        return replicated(self.mesh)

    def state(self, tree: Any) -> Any:
        """Shardings of a parameter / train-state tree by its logical names."""
        return state_shardings(tree, self.mesh, self.rules)

    def shard_batch(self, batch: Any) -> Any:
        return shard_batch(batch, self.mesh, self.rules)

    def take_rows(self, batch: Any, idx_R) -> Any:
        """Rows `idx_R` of a batch already placed by `shard_batch`, gathered on device
        straight into the batch sharding (no host round trip and no second placement);
        one compiled gather per batch structure."""
        ndims = tuple(x.ndim for x in jax.tree.leaves(batch))
        fn = _take_rows_fn(self, jax.tree.structure(batch), ndims)
        return fn(batch, put(np.asarray(idx_R, np.int32), self.replicated()))


@functools.lru_cache(maxsize=64)
def _take_rows_fn(layout: Layout, treedef, ndims: tuple[int, ...]):
    out = jax.tree.unflatten(treedef, [layout.batch(n) for n in ndims])
    return jax.jit(lambda batch, idx: jax.tree.map(lambda x: x[idx], batch), out_shardings=out)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
