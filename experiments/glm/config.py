"""GLM recipe: SFT -> Reasoning RL -> Agentic RL -> General RL, then cross-stage OPD.

Run (from the repository root):

    opd-jax experiment --config experiments/glm/config.py:reduced --workdir runs/glm

Domains stand in for GLM's stages on the testbed (docs/testbed.md; from the shipped base,
at its evaluation difficulty 3): reasoning = general (chain), agentic = agent (tool_chain,
multi-turn), general = coding (code_trace). Thinking is switched per prompt (<|think_on|> /
<|think_off|>) and, on the multi-turn agent domain, also per assistant turn (effort
think_mixed). General RL mixes a generative judge's score into its reward (``c.judge``).
Every stage is kimi_k3's specialist recipe (specialist SFT then GRPO, its settings) continuing
the line; the student is kimi_k3's student schedule with GLM's cross-stage objective.
Presets: ``reduced`` (the two domains that compete, general -> coding, no judge, 1 seed;
``--config.seeds="(0,1,2)"`` for the table), ``full`` (the three stages with per-turn
thinking and the judge, 3 seeds), ``smoke`` (tests; a random 1-layer model),
``scale_v5p64`` / ``scale_8xh100`` (every stage a Qwen3-1.7B on a TPU v5p-64 or 8xH100 mesh;
compile-checked, not run:
``python -m studies.scale_estimate --config experiments/glm/config.py:scale_8xh100``).
"""
import os

import ml_collections

from opd_jax.config import load_config
from opd_jax.recipes import policy_overrides as run
from opd_jax.recipes import on_testbed, shrink_for_smoke
from opd_jax.recipes import trainer_config as base
from opd_jax.recipes import TESTBED
from studies.scale_up import CHECKPOINTS, MESHES, STUDENT, apply_scale

KIMI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kimi_k3", "config.py")


def get_config(arg: str = "reduced") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipe = "glm"
    c.tokenizer = "synthetic"
    c.seeds = (0,)
    c.domains = dict(TESTBED)     # general: chain, agent: tool_chain, coding: code_trace
    c.efforts = ("think_on", "think_off")      # per prompt, on every domain
    # Domains that also train and evaluate thinking switched per assistant turn (effort
    # think_mixed: each turn's mode from the task's schedule, opened by its mode token).
    c.per_turn = ("agent",)
    # (stage, domains it trains on), in order (a tuple: ConfigDict maps do not keep order)
    c.stages = (("reasoning_rl", ("general",)), ("agentic_rl", ("agent",)),
                ("general_rl", ("coding",)))
    c.stage_teachers = {"general": "reasoning_rl", "agent": "agentic_rl",
                        "coding": "general_rl"}
    # The cold start: a short SFT of the shipped base on every domain's demos (all efforts).
    c.sft = base("sft.py:tasks", "--config.train.steps=30", "--config.train.ckpt_every=30",
                 "--config.optim.lr=3e-4", "--config.optim.warmup_steps=5")
    # Each stage first fine-tunes on its own domains' demos, then RL (train.steps=0: RL only).
    c.specialist_sft = base("sft.py:tasks", "--config.train.steps=60",
                            "--config.train.ckpt_every=60", "--config.optim.lr=5e-4",
                            "--config.optim.warmup_steps=5")
    c.rl = base("grpo.py:tiny", *run(steps=20, lr=2e-4, prompts=16))
    # Sampled-token OPD wants many rollouts per step at a small lr (the student sweep,
    # experiments/kimi_k3/README.md; the presets below set the measured values).
    c.student = base("opd.py:glm_cross_stage", *run(steps=40, lr=1e-4, prompts=64),
                     "--config.rl.minibatches=4")
    # GLM's General RL mixes a generative reward model into the verifier's reward: the
    # judge reads the rubric, the task, the reference and the final answer, and its score
    # (0-10 -> [0, 1]) is added with this weight (a `rewards.judge` section,
    # opd_jax/trainers/judge.py). The shipped base is not trained to judge: this wires the
    # path, it is not a tuned reward model.
    c.judge_stages = ("general_rl",)
    c.judge = ml_collections.ConfigDict(dict(
        path="builtin:base", weight=0.2, max_new_tokens=8, include_reference=True,
        rubric="Score 10 if the response is the program's printed output (the reference), "
               "else 0.", batch_size=64))
    c.merge = ml_collections.ConfigDict(dict(method="average"))
    c.eval = base("eval.py:grid").eval
    c.eval.n = 64
    on_testbed(c, ("sft", "specialist_sft"), ("rl", "student"))
    if arg in ("reduced", "full"):
        # The line starts from the dosed base itself (no cold start: its corpus taught the
        # formats, and a cold start on the domains' demos would spend their headroom). Every
        # stage is kimi_k3's specialist (its specialist SFT and GRPO sections), the student
        # kimi_k3's (its schedule, rollouts and evaluation) with GLM's objective, and the
        # report evaluates as kimi_k3's does (one definition: experiments/kimi_k3/config.py).
        kimi = ml_collections.ConfigDict(load_config(f"{KIMI}:reduced").to_dict())
        c.sft.train.update(dict(steps=0, ckpt_every=1))
        c.specialist_sft, c.rl = kimi.specialist_sft, kimi.teacher
        objective = c.student.objective
        c.student = kimi.student
        c.student.objective = objective
        c.eval.n = kimi.eval.n
    if arg == "reduced":
        # The two domains that compete (kimi_k3 measured each specialist losing 0.38 on the
        # other): reasoning on general, then general RL on coding; the judge is off (the
        # base cannot judge: `full` keeps the wiring).
        c.domains = {"general": "chain", "coding": "code_trace"}
        c.per_turn = ()
        c.stages = (("reasoning_rl", ("general",)), ("general_rl", ("coding",)))
        c.stage_teachers = {"general": "reasoning_rl", "coding": "general_rl"}
        c.judge_stages = ()
    elif arg == "full":
        c.seeds = (0, 1, 2)
    elif arg == "smoke":      # two RL stages; agent rides with reasoning (per-turn mode)
        c.stages = (("reasoning_rl", ("general", "agent")), ("general_rl", ("coding",)))
        c.stage_teachers = {"general": "reasoning_rl", "agent": "reasoning_rl",
                            "coding": "general_rl"}
        shrink_for_smoke(c, c.rl, c.student)
        c.specialist_sft.train.steps = 2
    elif arg in MESHES:          # scale_v5p64, scale_8xh100: real sizes, compile-checked
        c.specialist_sft.train.steps = 0
        apply_scale(c, arg)
        c.judge.update(dict(path=CHECKPOINTS[STUDENT], max_new_tokens=64))  # a placeholder
    else:
        raise KeyError(f"presets are reduced, full, smoke, {', '.join(MESHES)}; got {arg!r}")
    return c
