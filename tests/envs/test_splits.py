"""Held out by construction: train and eval problems never overlap, at any difficulty."""
import itertools

import numpy as np
import pytest

from opd_jax import envs
from opd_jax.data.corpus import demo_example, pretraining_corpus
from opd_jax.envs.data import split_of
from opd_jax.recipes import EVAL_DIFFICULTY
from opd_jax.recipes import TESTBED as TESTBED_DOMAINS

GENERATED = [f for f in envs.list_families() if envs.get_family(f).generate is not None]
CELLS = [(f, d) for f in GENERATED for d in range(1, envs.get_family(f).max_difficulty + 1)]
TESTBED = ("chain", "tool_chain", "code_trace")


def _canon(task):
    return envs.get_family(task.family).canonical_form(task.prompt, task.reference)


@pytest.mark.parametrize("family,difficulty", CELLS)
def test_train_and_eval_problems_are_disjoint(family, difficulty):
    # What the trainers draw (train split, several seeds) against what evaluation draws.
    train = [t for s in (0, 1) for t in envs.TaskSource(family, size=1500, seed=s,
                                                         difficulty=difficulty)]
    held = [t for s in (0, 7) for t in envs.TaskSource(family, size=150, seed=s,
                                                       difficulty=difficulty, split="eval")]
    assert {t.split for t in train} == {"train"} and {t.split for t in held} == {"eval"}
    assert all(split_of(t.family, t.prompt, t.reference) == t.split for t in train + held)
    assert not {_canon(t) for t in train} & {_canon(t) for t in held}
    if envs.get_family(family).canonical is None:   # the prompt is the problem
        assert not {t.prompt for t in train} & {t.prompt for t in held}


def _distinct(family, difficulty, split, target):
    """Draw up to 3x target tasks; the number of distinct problems among them."""
    seen = set()
    for t in envs.TaskSource(family, size=3 * target, seed=0, difficulty=difficulty,
                             split=split):
        seen.add(_canon(t))
        if len(seen) >= target:
            break
    return len(seen)


@pytest.mark.parametrize("family", TESTBED)
def test_testbed_families_have_2000_eval_and_20000_train_problems(family):
    # Difficulty 1 has the fewest operands, names or statements, hence the smallest space;
    # every higher difficulty only adds to the problem (the slow test checks them all).
    assert _distinct(family, 1, "eval", 2_000) == 2_000
    assert _distinct(family, 1, "train", 20_000) == 20_000


@pytest.mark.slow
@pytest.mark.parametrize("family,difficulty", [(f, d) for f in TESTBED for d in range(2, 6)])
def test_testbed_problem_counts_at_every_difficulty(family, difficulty):
    assert _distinct(family, difficulty, "eval", 2_000) == 2_000
    assert _distinct(family, difficulty, "train", 20_000) == 20_000


def test_split_is_part_of_the_task_and_survives_jsonl(tmp_path):
    tasks = [envs.TaskSource("chain", size=3, split=s)[i] for s in envs.SPLITS for i in range(3)]
    assert [t.split for t in tasks] == ["train"] * 3 + ["eval"] * 3
    assert "-eval-" in tasks[-1].id and "-train-" in tasks[0].id
    envs.save_jsonl(tasks, tmp_path / "t.jsonl")
    back = envs.load_jsonl(tmp_path / "t.jsonl")
    assert [t.split for t in back] == [t.split for t in tasks]
    assert [t.to_dict() for t in back] == [t.to_dict() for t in tasks]
    with pytest.raises(ValueError, match="split='test'"):
        envs.TaskSource("chain", size=3, split="test")
    with pytest.raises(ValueError, match="split='dev'"):
        envs.Task("x", "chain", "general", "high", "1+1=?", {"answer": "2"}, split="dev")


def test_same_index_same_problem_and_effort_does_not_change_it():
    a = envs.TaskSource("tool_chain", size=5, seed=3, difficulty=2, effort="low", split="eval")
    b = envs.TaskSource("tool_chain", size=5, seed=3, difficulty=2, effort="max", split="eval")
    assert [_canon(t) for t in a] == [_canon(t) for t in b]


def test_training_data_never_holds_eval_problems():
    held = envs.TaskSource("chain", size=1, split="eval")[0]
    with pytest.raises(ValueError, match="eval split"):
        demo_example(held)
    corpus = pretraining_corpus(per_cell=2, testbed_per_cell=3, efforts=("high",))
    eval_prompts = {envs.render_prompt(t) for f, d in CELLS
                    if envs.get_family(f).canonical is None and envs.get_family(f).chat is None
                    for t in envs.TaskSource(f, size=40, difficulty=d, effort="high",
                                             split="eval")}
    assert corpus and not {ex["prompt"] for ex in corpus} & eval_prompts


def test_tiny_split_fails_loudly():
    fam = envs.register_family(envs.TaskFamily(
        "_one_problem", "general", lambda rng, d: ("1+1=?", {"answer": "2"}),
        envs.get_family("chain").reward))
    want = "eval" if split_of(fam.name, "1+1=?", {}) == "train" else "train"
    with pytest.raises(ValueError, match=f"no '{want}' problem"):
        envs.TaskSource(fam.name, size=1, split=want)[0]


def test_testbed_scratchpads_grow_with_difficulty_and_bind_the_budgets():
    """Full scratchpads grow with difficulty. At the evaluation difficulty of chain and
    code_trace (the running-totals families) each budget sits inside the lengths of two
    adjacent forms, so an effort's pass rate mixes them and the efforts differ by
    construction: max fits every full scratchpad; high the full scratchpad of the shorter
    problems and every running-totals form; low the running totals of the shorter problems
    and every 2nd-total form."""
    budgets = {e: envs.DEFAULT_EFFORTS[e].think_budget for e in ("low", "high", "max")}
    for domain, fam in TESTBED_DOMAINS.items():
        full = [sum(envs.count_tokens(t.reference["forms"][0])
                    for t in envs.TaskSource(fam, size=50, difficulty=d, split="eval")) / 50
                for d in range(1, 6)]
        assert all(a < b for a, b in itertools.pairwise(full)), (fam, full)
        assert full[-1] <= budgets["max"], (fam, full)
        if fam == "tool_chain":
            continue
        tasks = list(envs.TaskSource(fam, size=200, difficulty=EVAL_DIFFICULTY[domain],
                                     split="eval"))
        lengths = np.array([[envs.count_tokens(f) for f in t.reference["forms"][:3]]
                            for t in tasks])
        full_, totals, every2 = lengths.T
        assert (full_ <= budgets["max"]).all() and (totals <= budgets["high"]).all(), fam
        assert (every2 <= budgets["low"]).all(), fam
        for form, budget in ((full_, budgets["high"]), (totals, budgets["low"])):
            fits = float(np.mean(form <= budget))
            assert 0.2 < fits < 0.8, (fam, budget, fits)


def test_a_dose_sets_the_demos_of_its_cells():
    """Issue 31's dosed corpus: the named (family, difficulty) cells get the dosed count per
    effort (0: none), every other cell its usual one."""
    from opd_jax.data.corpus import check_dose
    plain = pretraining_corpus(per_cell=2, testbed_per_cell=3, efforts=("high",))
    dosed = pretraining_corpus(per_cell=2, testbed_per_cell=3, efforts=("high",),
                               dose={"chain": {"3": 0, 4: 1}, "arithmetic": {"5": 4}})

    def count(corpus, needle):
        return sum(needle in ex["prompt"] for ex in corpus)
    by_cell = lambda corpus, fam, d: sum(  # noqa: E731
        1 for t in envs.TaskSource(fam, size=4, difficulty=d, effort="high", seed=0)
        if envs.render_prompt(t) in {ex["prompt"] for ex in corpus})
    assert by_cell(plain, "chain", 3) == 3 and by_cell(dosed, "chain", 3) == 0
    assert by_cell(dosed, "chain", 4) == 1 and by_cell(dosed, "arithmetic", 5) == 4
    assert len(dosed) == len(plain) - 3 + (1 - 3) + (4 - 2)   # chain d3, d4; arithmetic d5
    assert count(dosed, "<|high|>") == len(dosed)
    for bad, match in [({"nope": {"1": 1}}, "family 'nope'"),
                       ({"chain": {"9": 1}}, "difficulty '9': expected 1..5"),
                       ({"chain": {"2": -1}}, r"dose\['chain'\]\['2'\]=-1: expected an int")]:
        with pytest.raises(ValueError, match=match):
            check_dose(bad)
