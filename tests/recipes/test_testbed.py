"""The testbed's claims are computed from its rows: effort gaps for the base on every domain
and a specialist on its own, competition as the fall from the base on the other domains."""
from studies import testbed as tb


def _rows(rate):
    """Rows whose pass rate is rate(...); their reward is something else (a penalised
    reward that would rank efforts by construction), which the claims must not read."""
    return [{"model": m, "domain": d, "effort": e, "seed": s, "pass_rate": rate(m, d, e, s),
             "reward": {"low": 0.5, "high": 0.8, "max": 1.0}[e]}
            for m in ("base", *(f"specialist_{d}" for d in tb.TESTBED)) for d in tb.TESTBED
            for e in tb.EFFORTS for s in (0, 1)]


def test_effort_and_competition_claims():
    level = {"low": 0.1, "high": 0.3, "max": 0.45}

    def reward(m, d, e, s):
        r = level[e] + 0.01 * s
        if m == "specialist_general" and d == "agent":
            r -= 0.05                      # forgets less than the margin
        elif m.startswith("specialist_") and m != f"specialist_{d}":
            r -= 0.2
        if m == "base" and d == "coding" and e == "max":
            r = 0.35 + 0.01 * s            # max - high = 0.05, under the margin
        return r

    s = tb.summarize(_rows(reward))
    eff = {(r["model"], r["domain"]): r for r in s["effort"]}
    assert set(eff) == {("base", d) for d in tb.TESTBED} | {(f"specialist_{d}", d)
                                                           for d in tb.TESTBED}
    assert abs(eff[("base", "general")]["high_minus_low"] - 0.2) < 1e-9
    assert eff[("base", "general")]["pass"] and not eff[("base", "coding")]["pass"]
    comp = {(r["specialist"], r["domain"]): r for r in s["compete"]}
    assert len(comp) == 6
    assert not comp[("general", "agent")]["pass"]
    assert abs(comp[("general", "agent")]["drop_mean"] - 0.05) < 1e-9
    assert comp[("coding", "agent")]["pass"] and comp[("coding", "agent")]["drop_std"] < 1e-9
    assert s["metric"] == "pass_rate"
    assert not tb.summarize(_rows(lambda m, d, e, s: 0.5))["effort"][0]["pass"]
    md = tb.report_md(s, {"commit": "abc", "command": "cmd", "wall_s": 60.0,
                          "eval_difficulty": tb.EVAL_DIFFICULTY})
    assert "| base | coding | +0.200 ± 0.000 | +0.050 ± 0.000 | FAIL |" in md
