"""benchmarks/cost_curves.py --quick writes its markdown tables and both PNGs."""
from tests.benchmarks import load


def test_quick_run_writes_tables_and_plots(tmp_path):
    load("cost_curves").main(["--quick", "--out-dir", str(tmp_path)])
    md = (tmp_path / "cost_curves_cpu.md").read_text()
    assert "- command: `python benchmarks/cost_curves.py --quick --out-dir" in md and "load average before" in md
    assert "| 1 | 8 |" in md and "| 2 | 8 |" in md                       # rollout: batch x length
    assert "| N | 64 | 1024 |" in md and "| V | 32 | 2048 |" in md       # fused KL: both sweeps
    assert md.count("x |") >= 4                                         # ratios against the baselines
    for png in ("cost_curves_rollout_cpu.png", "cost_curves_kl_cpu.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
