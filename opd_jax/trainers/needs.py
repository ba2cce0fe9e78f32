"""What each policy objective declares (`Needs`) and where the fused full-vocabulary kernel
splits its work on a mesh (`VocabParallel`). The registry is in `opd_jax.trainers.objectives`.

The policy driver (`opd_jax.trainers.run_policy`) reads an objective's `Needs` to decide
what to build (teacher log-probs or hidden states, a reference model, old log-probs, the
vocab-parallel kernel) and checks it against the config before any work; it never tests
an objective's name. The objectives themselves live in `opd_jax.trainers.objectives`
(adding one: docs/objectives.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from opd_jax import sharding as sh

TEACHER_KINDS = ("none", "logp", "hidden", "topk")

Array = Any   # a jax.Array or numpy array of B rows


class PolicyBatch(TypedDict, total=False):
    """The batch of one policy iteration (rows B, targets T, teacher slots S), as the
    objectives read it: the sequence fields every batch has, then what `Needs` adds."""
    inputs: Array             # [B, T] int32 (`episodes.build_sequences`)
    targets: Array            # [B, T] int32
    mask: Array               # [B, T] 1 on sampled response targets (0: observations, pad)
    segment_ids: Array        # [B, T]
    positions: Array          # [B, T]
    sampler_logp: Array       # [B, T] the rollout engine's log-probs of the sampled tokens
    adv: Array                # [B] group advantages (a batch-mean baseline at group size 1)
    old_logp: Array           # [B, T] Needs.old_logp: under the sampler's distribution
    old_logp_plain: Array     # [B, T] Needs.old_logp: at T = 1
    ref_logp: Array           # [B, T] Needs.reference on: the frozen initial policy's
    teacher_logp: Array       # [B, T] Needs.teacher "logp": each row's teacher
    teacher_onehot: Array     # [B, S] Needs.teacher "logp" / "topk": the row's slot
    teacher_topk_ids: Array   # [B, T, K] int32 Needs.teacher "topk": the row teacher's top-k
    teacher_topk_logp: Array  # [B, T, K] their log-probs at the objective's temperature
    teacher_hidden: tuple     # S x [B, T, E_s] Needs.teacher "hidden"
    teacher_weights: Array    # [B, S] Needs.teacher "hidden": weights, sum 1 per row


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """Where the fused full-vocabulary kernel splits its work on the run's mesh: V over the
    one mesh axis `vocab_axis`, tokens (the flattened [B*T] rows) over `token_axis`. Passed
    to the kernel as ``mesh=, vocab_axis=, token_axis=`` (`pallas_kernels.fused_reverse_kl`);
    the unembeddings [D or E, V] enter the step sharded over V (`unembedding_sharding`)."""
    mesh: Mesh
    vocab_axis: str
    token_axis: str | tuple[str, ...] | None

    @classmethod
    def of(cls, mesh: Mesh, rules: sh.Rules, vocab_size: int,
           what: str = "the full-vocabulary kernel") -> VocabParallel | None:
        """The layout of `mesh` under `rules`, or None when they do not split the `vocab`
        logical axis (mesh axes of size 1 do not count). Raises when V does not divide over
        the vocab axis (the kernel's shards must be equal); `what` names the caller."""
        vocab, tokens = sh.vocab_parallel_axes(mesh, rules)
        if vocab is None:
            return None
        if not isinstance(vocab, str):
            raise ValueError(f"{what} splits the vocabulary over one mesh axis; mesh.rules map "
                             f"the 'vocab' logical axis to {vocab} (all of size > 1 on mesh "
                             f"{dict(mesh.shape)}). Map it to one axis")
        size = mesh.shape[vocab]
        if vocab_size % size:
            raise ValueError(
                f"{what} runs vocab-parallel over mesh axis {vocab!r} of size {size} (mesh "
                f"{dict(mesh.shape)}), but the vocabulary V={vocab_size} is not divisible by "
                f"{size}. Use a {vocab!r} axis size that divides V, pad the vocabulary "
                f"(model.vocab_size), or map the 'vocab' logical axis to no mesh axis in "
                f"mesh.rules (then the kernel runs on whole, replicated unembeddings)")
        return cls(mesh, vocab, tokens)

    def kernel_kw(self) -> dict:
        return {"mesh": self.mesh, "vocab_axis": self.vocab_axis, "token_axis": self.token_axis}

    def unembedding_sharding(self) -> NamedSharding:
        """An unembedding [E, V]: V over the vocab axis, E whole."""
        return NamedSharding(self.mesh, P(None, self.vocab_axis))


@dataclasses.dataclass(frozen=True)
class Needs:
    """What an objective reads, as data: the driver (`run_policy.train_policy`) builds the
    batch from this and checks the config against it before any work; it never tests an
    objective's name.

    teacher:        "none" (no teacher bank), "logp" (batch["teacher_logp"] [B, T] and
                    batch["teacher_onehot"] [B, S]), "hidden" (batch["teacher_hidden"]
                    S x [B, T, E_s], batch["teacher_weights"] [B, S], and the S teacher
                    unembeddings as the step's `teachers` argument) or "topk"
                    (batch["teacher_topk_ids"] / ["teacher_topk_logp"] [B, T, K], the row
                    teacher's K most likely tokens at the objective's temperature, and
                    batch["teacher_onehot"]; the objective has fields `top_k` and
                    `temperature`, read by `scoring_kw`).
    mixture:        teachers.routing="mixture" (several teachers weighted per row) allowed;
                    False means one teacher per episode.
    min_group_size: the smallest cfg.rollout.group_size that makes sense (GRPO's group
                    advantage needs 2; OPD works with 1).
    reference:      the name of the objective's option whose value > 0 turns on a KL to the
                    frozen initial policy (batch["ref_logp"]); None when it has none.
    old_logp:       batch["old_logp"] / ["old_logp_plain"] (the training forward before the
                    update, under the sampler's distribution and at T = 1). Every batch also
                    has inputs, targets, mask, segment_ids, sampler_logp and adv [B].
    vocab_parallel: (teacher "hidden" only) the objective's fused kernel can split V over
                    the mesh: the objective has a field `vocab_parallel` (a VocabParallel
                    or None) that `on_mesh` fills from the run's mesh, and the teacher
                    unembeddings then enter the step sharded over V.
    """
    teacher: str = "none"
    mixture: bool = False
    min_group_size: int = 1
    reference: str | None = None
    old_logp: bool = True
    vocab_parallel: bool = False

    def __post_init__(self):
        if self.teacher not in TEACHER_KINDS:
            raise ValueError(f"Needs.teacher={self.teacher!r}: expected one of {TEACHER_KINDS}")
        if self.mixture and self.teacher == "none":
            raise ValueError("Needs.mixture=True needs a teacher ('logp', 'hidden' or 'topk')")
        if self.vocab_parallel and self.teacher != "hidden":
            raise ValueError(f"Needs.vocab_parallel=True shards teacher unembeddings; it needs "
                             f"teacher='hidden', got teacher={self.teacher!r}")

    def scoring_kw(self, objective) -> dict:
        """How the teachers score for `objective`: for the top-k signal its ``top_k`` and
        ``temperature`` (the teacher is scored at the temperature the loss applies to the
        student: one value, so the two sides cannot differ); for the hidden-state signal the
        temperature its entropies (confidence weighting) are taken at; otherwise nothing."""
        if self.teacher == "topk":
            return {"top_k": int(objective.top_k), "temperature": float(objective.temperature)}
        if self.teacher == "hidden":
            return {"temperature": float(getattr(objective, "temperature", 1.0))}
        return {}

    def wants_reference(self, objective) -> bool:
        """True when `objective`'s reference option is on (> 0)."""
        return self.reference is not None and getattr(objective, self.reference) > 0

    def on_mesh(self, objective, mesh: Mesh, rules: sh.Rules, vocab_size: int):
        """`objective` for a run on `mesh`: with `vocab_parallel` declared and the mesh
        splitting the `vocab` logical axis, a copy whose `vocab_parallel` field holds the
        layout (V must divide over that axis: ValueError naming V and the axis size);
        otherwise `objective` unchanged. The driver calls this before any work."""
        if not self.vocab_parallel:
            return objective
        layout = VocabParallel.of(mesh, rules, vocab_size,
                                  what=f"objective {type(objective).name!r}")
        return objective if layout is None else dataclasses.replace(objective,
                                                                    vocab_parallel=layout)

    def unembedding_sharding(self, objective, mesh: Mesh) -> NamedSharding:
        """How each teacher unembedding [E, V] enters the step: sharded over V when
        `objective` runs vocab-parallel (see `on_mesh`), replicated otherwise."""
        layout = getattr(objective, "vocab_parallel", None) if self.vocab_parallel else None
        return layout.unembedding_sharding() if layout is not None else NamedSharding(mesh, P())

    def check(self, name: str, cfg, mixture_objectives: list[str] = ()) -> None:
        """Refuse a config this objective cannot run, naming the value and what it expects
        (`mixture_objectives`: the registered ones that allow routing="mixture")."""
        G = cfg.rollout.group_size
        if G < self.min_group_size:
            raise ValueError(f"objective {name!r} needs rollout.group_size >= "
                             f"{self.min_group_size} (its advantage compares episodes of a "
                             f"group); got group_size={G}")
        if self.teacher == "none":
            return
        routing = cfg.teachers.routing
        weighting = cfg.teachers.get("weighting", "static")
        if weighting == "confidence" and not (self.mixture and self.teacher == "hidden"):
            raise ValueError(f"objective {name!r}: teachers.weighting='confidence' weights "
                             f"several teachers per token from their full distributions; it "
                             f"needs an objective that mixes hidden-state teachers: "
                             f"{sorted(mixture_objectives)}")
        if routing in ("mixture", "uniform") and not self.mixture:
            raise ValueError(f"objective {name!r} scores each episode with one teacher; "
                             f"teachers.routing={routing!r} weights several per episode. Use "
                             f"routing 'cell', 'domain' or 'table', or an objective that "
                             f"allows mixtures: {sorted(mixture_objectives)}")
        if not dict(cfg.teachers.paths):
            raise ValueError(f"objective {name!r} needs teachers (Needs.teacher="
                             f"{self.teacher!r}); teachers.paths is empty")
