"""Issue 30 case 8: an experiment re-run with a changed finished stage is refused before it
writes anything, so the top-level config.json and provenance.json keep describing the
results beside them."""
import json
import os

import pytest

from opd_jax.config import load_config
from opd_jax.recipes import recipe_module, run_experiment
from opd_jax.recipes.pipeline import stage_identity
from tests.faults.conftest import ROOT, snapshot


def test_a_changed_finished_stage_is_refused_before_any_write(tmp_path):
    c = load_config(os.path.join(ROOT, "experiments/kimi_k3/config.py:smoke"))
    first = recipe_module("kimi_k3").build(c, 0)[0]
    sft_dir = tmp_path / "seed0" / first.name
    sft_dir.mkdir(parents=True)
    old = stage_identity(first)
    old["config"]["optim"]["lr"] = 0.5                 # it finished with another lr
    (sft_dir / "done.json").write_text(json.dumps({"identity": old, "wall_s": 1.0}))
    (tmp_path / "config.json").write_text('{"recipe": "kimi_k3", "as": "before"}')
    (tmp_path / "provenance.json").write_text('{"command": "before", "commit": "x"}')
    kept = snapshot(str(tmp_path))
    with pytest.raises(ValueError, match=r"stage 'sft' in .* finished with other settings "
                                         r"\(1 differ: config.optim.lr: 0.5 -> "):
        run_experiment(c, str(tmp_path), progress=False)
    assert snapshot(str(tmp_path)) == kept
