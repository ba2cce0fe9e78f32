"""Case 2 and the storage failures: a corrupt or unreadable latest checkpoint falls back to
the previous intact step (named in a warning, the bad one moved aside, never deleted);
a non-finite state is never saved; HF weights with NaN bytes or a broken safetensors
header fail naming the tensor and file."""
import functools
import json
import os
import shutil
import warnings

import jax
import numpy as np
import pytest

from opd_jax.checkpoint import Checkpointer, CheckpointError, abstract_like
from opd_jax.models import ModelConfig, load_pretrained, save_pretrained
from opd_jax.models.safetensors_io import SKIP_FINITE_ENV
from opd_jax.trainers import builders
from opd_jax.trainers.run_sft import train_sft
from opd_jax.trainers.state import create_state, make_optimizer, place_state
from tests.faults.conftest import sft_cfg, snapshot
from tests.models.helpers import random_model
from tests.trainers.test_sft import _final_params


def _data_files(step_dir):
    """The OCDBT data files of a step's train state (which hold which array is internal).

    Orbax writes them under `ocdbt.process_0/d/` and, when it merges the per-process
    databases at commit (timing-dependent), also under `state/d/`; the restore may read
    either, so both are corrupted/listed."""
    out = []
    for d in (os.path.join(step_dir, "state", "ocdbt.process_0", "d"),
              os.path.join(step_dir, "state", "d")):
        if os.path.isdir(d):
            out += [os.path.join(d, f) for f in os.listdir(d)]
    assert out, f"no OCDBT data files under {step_dir}/state"
    return sorted(out)


def _flip_middle(path, n=16):
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    open(path, "wb").write(bytes(data))


def test_corrupt_state_bytes_fall_back_and_recover_bitwise(good_run, run_copy):
    """Flipped bytes in the latest step's array data: the run warns naming steps 8 and 4,
    resumes from 4 and ends with the same parameters as the intact run."""
    good, _ = good_run
    kept = snapshot(run_copy / "checkpoints" / "4")
    for f in _data_files(run_copy / "checkpoints" / "8"):
        _flip_middle(f)
    with pytest.warns(RuntimeWarning, match="checkpoint step 8 under .* is corrupt or "
                                            "unreadable .*previous intact step 4"):
        out = train_sft(sft_cfg(), str(run_copy), progress=False)
    assert out["step"] == 8
    assert (run_copy / "checkpoints" / "8.corrupt").is_dir()       # kept, moved aside
    assert snapshot(run_copy / "checkpoints" / "4") == kept
    for x, y in zip(jax.tree.leaves(_final_params(good, 8)),
                    jax.tree.leaves(_final_params(run_copy, 8))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.lru_cache(maxsize=1)
def _abstract_state():
    cfg = sft_cfg()
    mesh, rules, _, _ = builders.setup(cfg)
    model = builders.build_model(cfg.model, mesh, rules, seed=0)
    _, state = create_state(model, make_optimizer(cfg.optim, cfg.train.steps))
    return abstract_like(place_state(state, mesh, rules)[0])


def _bad_checksum(step_dir):
    path = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(path))
    name = next(k for k in meta["checksums"] if k.startswith(".opt_state"))
    meta["checksums"][name] ^= 1
    json.dump(meta, open(path, "w"))
    return name


@pytest.mark.parametrize("damage", ["checksum", "metadata", "truncated"])
def test_unreadable_latest_step_falls_back(run_copy, damage):
    step8 = str(run_copy / "checkpoints" / "8")
    kept = snapshot(run_copy / "checkpoints" / "4")
    if damage == "checksum":        # readable, wrong bytes: only the checksum can tell
        what = _bad_checksum(step8).replace("[", "\\[").replace("]", "\\]")
        what = f"array {what} does not match the checksum"
    elif damage == "metadata":
        open(os.path.join(step8, "meta", "metadata"), "w").write('{"model": {tru')
        what = "step 8"
    else:
        for f in _data_files(step8):
            os.truncate(f, os.path.getsize(f) // 3)
        what = "step 8"
    ckpt = Checkpointer(str(run_copy / "checkpoints"))
    with pytest.warns(RuntimeWarning, match=f"{what}.*resumed from the previous intact step 4"):
        state, meta = ckpt.restore(None, _abstract_state())
    ckpt.close()
    assert int(state.step) == 4 and meta["model"]["hidden_size"] == 32
    assert sorted(os.listdir(run_copy / "checkpoints")) == ["4", "8.corrupt"]
    assert snapshot(run_copy / "checkpoints" / "4") == kept
    # An explicit step is never replaced by another: it fails naming the folder.
    _bad_checksum(str(run_copy / "checkpoints" / "4"))
    with pytest.raises(CheckpointError, match="checkpoints/4: array .* checksum"):
        Checkpointer(str(run_copy / "checkpoints")).restore(4, _abstract_state())


def test_no_flipped_byte_restores_silently(run_copy, tmp_path):
    """Flip 16 bytes in each data file of the latest step in turn: the restore either reads
    exactly the saved arrays (the bytes were not array data) or falls back to step 4 with
    a warning (a decode error, or a checksum mismatch when the bytes still decode).
    Orbax also writes files the restore does not read; flips there change nothing."""
    ckpt = Checkpointer(str(run_copy / "checkpoints"))
    ref, _ = ckpt.restore(8, _abstract_state())
    ref = [np.asarray(x) for x in jax.tree.leaves(ref)]
    ckpt.close()
    reasons = []
    for i, f in enumerate(_data_files(run_copy / "checkpoints" / "8")):
        copy = tmp_path / f"c{i}"
        shutil.copytree(run_copy / "checkpoints", copy)
        _flip_middle(f.replace(str(run_copy / "checkpoints"), str(copy)))
        ckpt = Checkpointer(str(copy))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = ckpt.restore(None, _abstract_state())
        ckpt.close()
        fell_back = [str(w.message) for w in caught if "corrupt or unreadable" in str(w.message)]
        if int(state.step) == 8:
            assert not fell_back
            for x, y in zip(ref, jax.tree.leaves(state)):
                np.testing.assert_array_equal(x, np.asarray(y))
        else:
            assert int(state.step) == 4 and len(fell_back) == 1
            reasons.append(fell_back[0])
    # Which file holds which array is Orbax's business: at least one flip hit array data.
    assert reasons and all("step 8 under" in r and "step 4" in r for r in reasons)


def test_no_intact_step_is_an_error_naming_each(run_copy):
    for s in ("4", "8"):
        _bad_checksum(str(run_copy / "checkpoints" / s))
    with pytest.raises(CheckpointError, match="no intact checkpoint under .*step 8: "
                                              "CheckpointError.*step 4: CheckpointError"):
        Checkpointer(str(run_copy / "checkpoints")).restore(None, _abstract_state())
    assert sorted(os.listdir(run_copy / "checkpoints")) == ["4", "8"]


def test_a_nonfinite_state_is_never_saved(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "c"), async_save=False)
    good = {"w": jax.numpy.ones(4), "b": jax.numpy.zeros(2)}
    ckpt.save(1, good, None, {"kind": "test"})
    kept = snapshot(tmp_path / "c")
    bad = {"w": jax.numpy.array([1.0, np.inf, 0.0, 1.0]), "b": jax.numpy.zeros(2)}
    with pytest.raises(CheckpointError, match="refusing to write checkpoint 2 .*array "
                                              "\\['w'\\] holds NaN or inf.*\\[1\\] are kept"):
        ckpt.save(2, bad, None, {"kind": "test"})
    ckpt.close()
    assert snapshot(tmp_path / "c") == kept


TINY_HF = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_embeddings=True)


def _hf_folder(path):
    save_pretrained(random_model(TINY_HF, seed=3), path)
    # A folder from elsewhere (a hub download) has no identity.json: the header and finite
    # checks below are what guard it (an export's identity catches any changed byte first).
    os.remove(os.path.join(path, "identity.json"))
    return os.path.join(path, "model.safetensors")


def test_nan_bytes_in_hf_weights_fail_naming_the_tensor(tmp_path, monkeypatch):
    file = _hf_folder(tmp_path / "hf")
    data = bytearray(open(file, "rb").read())
    n = int.from_bytes(data[:8], "little")
    name, info = next((k, v) for k, v in json.loads(data[8:8 + n]).items()
                      if k.endswith("down_proj.weight"))
    at = 8 + n + info["data_offsets"][0] + 4 * 5          # the 6th float32 of that tensor
    data[at:at + 4] = np.float32(np.nan).tobytes()
    open(file, "wb").write(bytes(data))
    kept = snapshot(file)
    with pytest.raises(ValueError, match=f"tensor '{name}' in .*hf holds a non-finite value "
                                         f"\\(nan at flat index 5\\)"):
        load_pretrained(tmp_path / "hf")
    monkeypatch.setenv(SKIP_FINITE_ENV, "1")      # the documented opt-out loads it
    assert load_pretrained(tmp_path / "hf").config.hidden_size == 16
    assert snapshot(file) == kept


@pytest.mark.parametrize("damage, match", [
    ("truncated_header", "model.safetensors: not a safetensors file \\(truncated"),
    ("garbage_header", "model.safetensors: the safetensors header is not valid JSON"),
    ("truncated_data", "tensor '.*' in .*model.safetensors: bytes \\[\\d+, \\d+\\) do not "
                       "hold a F32"),
])
def test_broken_safetensors_name_the_file_and_tensor(tmp_path, damage, match):
    file = _hf_folder(tmp_path / "hf")
    data = open(file, "rb").read()
    n = int.from_bytes(data[:8], "little")
    if damage == "truncated_header":
        data = data[:8 + n // 2]
    elif damage == "garbage_header":
        data = data[:8] + b"\xff{not json" + data[18:]
    else:
        data = data[:len(data) - 64]
    open(file, "wb").write(data)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path / "hf")


def test_teacher_params_with_a_bad_checksum_fail_naming_the_array(run_copy):
    """Teachers and eval read params only (`restore_params`): checked the same way, and an
    explicit read never substitutes another step."""
    from opd_jax.models import ModelRef
    path = os.path.join(run_copy, "checkpoints", "8", "meta", "metadata")
    meta = json.load(open(path))
    name = next(k for k in meta["checksums"] if k.startswith(".params"))
    meta["checksums"][name] ^= 1
    json.dump(meta, open(path, "w"))
    with pytest.raises(CheckpointError, match=f"checkpoints/8: array "
                                              f"{name.replace('[', '.').replace(']', '.')} "
                                              f"does not match the checksum"):
        ModelRef(str(run_copy)).load()


def test_an_edited_iterator_state_falls_back_like_a_corrupt_step(run_copy):
    """Issue 30 case 7: next_index edited by one resumed silently on other data; the
    iterator's state is now in the integrity check, so the step falls back."""
    step8 = run_copy / "checkpoints" / "8" / "data"
    path = next(p for p in step8.iterdir() if p.name.startswith("process_"))
    text = path.read_text()
    state = json.loads(text)
    key = "next_index" if "next_index" in state else None
    if key is None:           # grain nests it in the parent iterator's state
        state["parent"]["next_index"] += 1
    else:
        state[key] += 1
    path.write_text(json.dumps(state))
    with pytest.warns(RuntimeWarning, match="checkpoint step 8 under .* is corrupt or "
                                            "unreadable .*data iterator's state.*previous "
                                            "intact step 4"):
        out = train_sft(sft_cfg(), str(run_copy), progress=False)
    assert out["step"] == 8 and (run_copy / "checkpoints" / "8.corrupt").is_dir()


def test_an_hf_folder_without_weights_says_so(tmp_path):
    """Issue 30: the shipped base without its weights file said "no Orbax checkpoint"."""
    from opd_jax.models import ModelRef
    from opd_jax.models.builtin import builtin_path
    folder = tmp_path / "base"
    shutil.copytree(builtin_path("base"), folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match=f"{folder} holds a config.json but no "
                                                f"\\*.safetensors weights"):
        ModelRef(str(folder)).load()


def test_a_corrupt_teacher_fails_before_any_rollout(run_copy, tmp_path):
    """Issue 30: a corrupt teacher checkpoint failed after a rollout, with 11 tracebacks;
    teachers are now opened (and checked) before the first rollout, and before the
    workdir is written."""
    from opd_jax.config import load_config
    from opd_jax.trainers.run_policy import train_policy
    from tests.faults.conftest import ROOT
    _bad_checksum(str(run_copy / "checkpoints" / "8"))
    for f in _data_files(run_copy / "checkpoints" / "8"):
        _flip_middle(f)
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"),
                      [f"--config.teachers.paths={{'general/high': '{run_copy}'}}"])
    with pytest.raises(CheckpointError, match=f"teacher 'general/high' at {run_copy}: .*"
                                              f"checkpoints/8"):
        train_policy(cfg, str(tmp_path / "student"), progress=False)
    assert not (tmp_path / "student").exists()
