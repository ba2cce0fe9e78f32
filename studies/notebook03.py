"""Notebook 03's results: the derived numbers, the claims and the markdown table, as functions
of its results file alone (``notebooks/results/03_tiny_mopd.json``).

The notebook (``notebooks/03_tiny_mopd.ipynb``) evaluates every model on the same held-out
problems and records, per cell, each model's per-problem pass (``"passes"``: one character
per problem, "1" where the verifier passed); everything else in a cell (pass rates, paired
differences, gain kept) is `derive` of those strings, and `load` refuses a file where it is
not, so a hand-edited number fails. Then:

    results = notebook03.load("notebooks/results/03_tiny_mopd.json")
    notebook03.claims(results)          # [(name, passed, text)], what the notebook asserts
    notebook03.write_markdown("notebooks/results/03_tiny_mopd.json",
                              "notebooks/results/03_tiny_mopd.md")
"""
from __future__ import annotations

import json
import math

import numpy as np

from opd_jax.recipes import report as rp

MODELS = ("start", "specialist_general", "specialist_coding", "merge", "student")
GAIN_K = 3.0      # specialists and student beat the start beyond 3 se
MERGE_K = 2.0     # the student beats the merge beyond 2 se
CLAIMS = ("specialists_gain", "student_gains", "student_beats_merge")


def pass_string(passes) -> str:
    """Per-problem passes (0/1 numbers) as the results file stores them: "0110..."."""
    out = []
    for p in passes:
        if p not in (0, 1):
            raise ValueError(f"a per-problem pass is 0 or 1, got {p!r}")
        out.append("1" if p else "0")
    return "".join(out)


def _passes(s: str) -> np.ndarray:
    if not s or set(s) - {"0", "1"}:
        raise ValueError(f"passes {s[:20]!r}...: expected a non-empty string of 0 and 1")
    return np.array([c == "1" for c in s], np.float64)


def derive(passes: dict[str, str], teacher: str) -> dict:
    """A cell's numbers from its models' pass strings (`MODELS`; the same problems, in the
    same order) and the name of its teacher (the specialist of its domain): pass rates,
    model - start and student - merge paired per problem with their se, gain kept =
    (model - start) / (teacher - start) for the student and the merge (NaN where the
    teacher did not gain)."""
    missing = [m for m in MODELS if m not in passes]
    if missing or teacher not in MODELS:
        raise ValueError(f"a cell needs passes of {MODELS} and a teacher among them; "
                         f"missing {missing}, teacher {teacher!r}")
    p = {m: _passes(passes[m]) for m in MODELS}
    n = {len(v) for v in p.values()}
    if len(n) != 1:
        raise ValueError(f"every model needs one pass per problem, got lengths "
                         f"{ {m: len(v) for m, v in p.items()} }")
    vs = {m: rp.paired(p[m], p["start"]) for m in MODELS if m != "start"}
    gain = vs[teacher]["diff"]
    return {"n": n.pop(), "pass_rate": {m: float(v.mean()) for m, v in p.items()},
            "vs_start": vs, "student_vs_merge": rp.paired(p["student"], p["merge"]),
            "gain_kept": {m: rp.ratio(vs[m]["diff"], gain) for m in ("student", "merge")}}


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9,
                                                                 abs_tol=1e-12)
    return a == b


def check(results: dict) -> None:
    """Refuse results whose numbers are not `derive` of their passes, or whose claims are
    not `claims` of them (a hand-edited file)."""
    for cell, c in results["cells"].items():
        derived = derive(c["passes"], c["teacher"])
        stored = {k: c.get(k) for k in derived}
        if not _same(stored, derived):
            bad = sorted(k for k in derived if not _same(stored[k], derived[k]))
            raise ValueError(f"{cell}: {bad} differ from what its passes give; the results "
                             f"file was edited or written by other code")
    if [tuple(x) for x in results.get("claims", [])] != claims(results):
        raise ValueError("the results file's claims differ from claims(results)")


def load(path: str) -> dict:
    """A results file, checked (`check`)."""
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    check(results)
    return results


def _said(p: dict) -> str:
    return f"{p['diff']:+.3f} (se {p['se']:.3f})"


def claims(results: dict) -> list[tuple[str, bool, str]]:
    """What the notebook asserts, from the results alone: [(name, passed, text)].

    * ``specialists_gain``: each specialist beats the start on its own cell beyond GAIN_K se;
    * ``student_gains``: the student beats the start on every cell beyond GAIN_K se;
    * ``student_beats_merge``: the student beats the merge on every cell beyond MERGE_K se.
    """
    cells = results["cells"]

    spec = {cell: c["vs_start"][c["teacher"]] for cell, c in cells.items()}
    student = {cell: c["vs_start"]["student"] for cell, c in cells.items()}
    merge = {cell: c["student_vs_merge"] for cell, c in cells.items()}
    listed = lambda ps: ", ".join(f"{cell} {_said(p)}" for cell, p in ps.items())
    return [
        ("specialists_gain", all(rp.beats(p, 0.0, GAIN_K) for p in spec.values()),
         f"each specialist beats the start on its own cell beyond {GAIN_K:g} se: "
         + listed(spec)),
        ("student_gains", all(rp.beats(p, 0.0, GAIN_K) for p in student.values()),
         f"the student beats the start on every cell beyond {GAIN_K:g} se: " + listed(student)),
        ("student_beats_merge", all(rp.beats(p, 0.0, MERGE_K) for p in merge.values()),
         f"the student beats the merge on every cell beyond {MERGE_K:g} se: " + listed(merge)),
    ]


def markdown(results: dict) -> str:
    """The results table, the claims and the in-run curve as markdown."""
    cells, ev = results["cells"], results["eval"]
    rows = []
    for cell, c in cells.items():
        pr, vs = c["pass_rate"], c["vs_start"]
        rows.append([cell, f"{pr['start']:.3f}", f"{pr[c['teacher']]:.3f}",
                     _said(vs[c["teacher"]]), f"{pr['merge']:.3f}", _said(vs["merge"]),
                     f"{pr['student']:.3f}", _said(vs["student"]),
                     f"{c['gain_kept']['student']:.1%}", f"{c['gain_kept']['merge']:.1%}",
                     _said(c["student_vs_merge"])])
    every = [[m, *[f"{c['pass_rate'][m]:.3f}" for c in cells.values()]] for m in MODELS]
    steps = sorted({s for c in cells.values() for s, _ in c["curve"]})
    curve = [[str(s), *[next((f"{v:.3f}" for t, v in c["curve"] if t == s), "-")
                        for c in cells.values()]] for s in steps]
    load, st = results["load"], results["settings"]
    lines = [
        "# Notebook 03: multi-teacher OPD from the shipped base, the main job in miniature", "",
        f"Written by `{results['notebook']}` (seed {results['seed']}, commit "
        f"{results['commit']}) in {results['wall_s']:.0f} s of wall time on "
        f"{load['cpus']} CPU cores (1-minute load average {load['start']:.1f} at the start, "
        f"{load['end']:.1f} at the end); generated from `03_tiny_mopd.json` by "
        f"`studies.notebook03.write_markdown`.", "",
        f"Settings (`{st['config']}`, restricted to the two cells): each specialist is SFT of "
        f"the start on its domain's demos, {st['specialist_sft_steps']} steps at lr "
        f"{st['specialist_sft_lr']:g}; the merge is {st['merge']} of the two at scale "
        f"{st['merge_scale']:g}; the student is `{st['objective']}` OPD from the merge, "
        f"{st['student_iterations']} iterations of {st['student_prompts_per_step']} rollouts "
        f"({st['student_minibatches']} minibatches), lr {st['student_lr']:g} "
        f"({st['student_schedule']}); {st['max_new_tokens']} new tokens per turn. No GRPO "
        f"rungs (the main job adds them).", "",
        f"Pass rate (verifier correctness) on {ev['n']} held-out problems per cell ({ev['split']} "
        f"split, difficulty {ev['difficulty']}, greedy), the same problems for every model. "
        f"Differences are paired per problem; se counts problems. Gain kept = (model - start) "
        f"/ (teacher - start); the teacher of a cell is its domain's specialist.", "",
        rp.markdown_table(["cell", "start", "teacher", "teacher - start (se)", "merge",
                           "merge - start (se)", "student", "student - start (se)",
                           "student gain kept", "merge gain kept", "student - merge (se)"],
                          rows), "",
        "## Claims (asserted by the notebook)", "",
        *[f"- **{'PASS' if ok else 'FAIL'}** {text}" for _, ok, text in claims(results)], "",
        "## Every model on every cell", "",
        rp.markdown_table(["model", *cells], every), "",
        f"## The student's in-run held-out pass rate ({results['settings']['student_eval_n']} "
        f"problems per cell, its own draw)", "",
        rp.markdown_table(["iteration", *cells], curve), ""]
    return "\n".join(lines)


def write_markdown(json_path: str, md_path: str) -> str:
    """The results file's markdown (`markdown` of the checked `load`), written to md_path;
    returns it."""
    md = markdown(load(json_path))
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(md)
    return md
