"""Config sections shared by the config files here (imported as a sibling); not a config.

Every default, type and range is declared once, in the schema (opd_jax/schema_sections.py;
objective options on the objective's dataclass); these build sections from it."""
import ml_collections

from opd_jax.trainers.config_schema import section
from opd_jax.trainers.objectives import default_options


def objective(name: str, **options) -> ml_collections.ConfigDict:
    """``objective`` section: the objective's declared options at their defaults, then
    `options` (the mismatch correction: --config.objective.options.correction.kind=tis)."""
    return ml_collections.ConfigDict(dict(name=name, options=default_options(name, **options)))


def policy_base(init_from: str = "") -> ml_collections.ConfigDict:
    """The sections every policy trainer (GRPO, OPD) shares."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = section("model", init_from=init_from)
    c.tokenizer = "synthetic"
    c.tasks = section("tasks")
    c.rollout = section("rollout")
    c.eval = section("eval")
    c.rl = section("rl")
    # A generative reward model mixed into the task reward (opd_jax/trainers/judge.py):
    # training reward = task + weight * judge score in [0, 1]; path "" = no judge.
    c.rewards = section("rewards")
    c.optim = section("optim", lr=1e-4, warmup_steps=0, schedule="constant", weight_decay=0.0)
    c.train = section("train", steps=30, log_every=1, ckpt_every=10)
    c.mesh = section("mesh")
    return c
