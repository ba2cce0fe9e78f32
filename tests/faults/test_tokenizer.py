"""Case 9: teachers and students compare tokenizer identity (vocabulary + special tokens,
recorded in every checkpoint), not only the vocabulary size."""
import os

import pytest

from opd_jax.checkpoint import read_step_meta
from opd_jax.config import load_config
from opd_jax.models.tokenizers import char_tokenizer, synthetic_tokenizer
from opd_jax.teachers import TeacherBank
from opd_jax.models import tokenizer_fingerprint
from opd_jax.trainers.run_policy import train_policy
from opd_jax.trainers.run_sft import train_sft
from tests.faults.conftest import ROOT, sft_cfg


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A char-level tokenizer of the synthetic one's size whose characters are in reverse
    order: every id means another character."""
    fast = char_tokenizer([chr(c) for c in range(126, 31, -1)] + ["\n"])
    path = str(tmp_path_factory.mktemp("tok") / "reversed")
    fast.save_pretrained(path)
    assert len(fast) == len(synthetic_tokenizer())
    return path


def test_every_checkpoint_records_its_tokenizer(good_run):
    meta = read_step_meta(str(good_run[0] / "checkpoints" / "8"))
    assert meta["tokenizer"] == {"spec": "synthetic",
                                 "fingerprint": tokenizer_fingerprint(synthetic_tokenizer())}


def test_teacher_with_another_tokenizer_of_the_same_size_is_refused(good_run, other_tokenizer,
                                                                    tmp_path):
    teacher = str(good_run[0])
    from opd_jax.models import build_tokenizer
    ours, theirs = (tokenizer_fingerprint(t) for t in (build_tokenizer(other_tokenizer),
                                                       synthetic_tokenizer()))
    assert ours != theirs
    bank = TeacherBank({"general/high": teacher})
    bank.validate(128, synthetic_tokenizer(), "synthetic")      # the same tokenizer passes
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"), [
        f"--config.tokenizer={other_tokenizer}",
        f"--config.teachers.paths={{'general/high': '{teacher}'}}"])
    with pytest.raises(ValueError, match=f"teacher 'general/high' at '{teacher}' was trained "
                                         f"with tokenizer 'synthetic' \\(fingerprint {theirs}"
                                         f"\\), but this run uses tokenizer "
                                         f"'{other_tokenizer}' \\(fingerprint {ours}\\)"):
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


def test_student_init_from_another_tokenizer_is_refused(good_run, other_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="model.init_from '.*good' was trained with tokenizer "
                                         "'synthetic'"):
        train_sft(sft_cfg(f"--config.tokenizer={other_tokenizer}",
                          f"--config.model.init_from={good_run[0]}"),
                  str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


def test_eval_with_another_tokenizer_is_refused(good_run, other_tokenizer):
    """Issue 30 case 9: eval reported 0.000 rewards as real for a checkpoint trained with
    another tokenizer."""
    from opd_jax.trainers.evaluate import evaluate_checkpoint
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/eval.py"),
                      [f"--config.tokenizer={other_tokenizer}"])
    with pytest.raises(ValueError, match="eval checkpoint .* was trained with tokenizer "
                                         "'synthetic'.*Use the same tokenizer"):
        evaluate_checkpoint(str(good_run[0]), cfg)


def test_a_tokenizer_folder_without_tokenizer_files_names_it(tmp_path):
    from opd_jax.models import load_tokenizer
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"tokenizer folder '{tmp_path}/empty' holds "
                                                f"no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))


def test_a_teacher_shorter_than_the_rollouts_is_refused_before_work(tmp_path):
    """Issue 30 case 3: a teacher with max_position_embeddings=16 scored 25-position
    sequences (the positions check covered students only)."""
    from opd_jax.models import ModelConfig, save_pretrained
    from tests.models.helpers import random_model
    short = tmp_path / "short"
    cfg16 = ModelConfig.preset("tiny").replace(vocab_size=128, max_position_embeddings=16)
    save_pretrained(random_model(cfg16), str(short))
    synthetic_tokenizer().save_pretrained(str(short))
    cfg = load_config(os.path.join(ROOT, "opd_jax/configs/opd.py:kimi_mopd"), [
        f"--config.teachers.paths={{'general/high': '{short}'}}",
        "--config.rollout.sampling.max_new_tokens=24"])
    with pytest.raises(ValueError, match="rollout.sampling.max_new_tokens=24: expected fewer "
                                         "than teacher 'general/high''s "
                                         "max_position_embeddings=16"):
        train_policy(cfg, str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


# -- issue 30, one identity per model (cases 1, 2, 4) ---------------------------------------

def test_the_shipped_base_records_its_tokenizer_and_content():
    """Case 1: the base shipped only its vocabulary size; now identity.json names its
    tokenizer and the sha256 of its files, and loading it verifies them."""
    from opd_jax.models import ModelRef
    from opd_jax.models.builtin import builtin_path
    from opd_jax.models.identity import read_identity, verify_identity
    record = read_identity(builtin_path("base"))
    assert record["tokenizer"] == {"spec": "synthetic",
                                   "fingerprint": tokenizer_fingerprint(synthetic_tokenizer())}
    assert set(record["files"]) == {"config.json", "model.safetensors"}
    assert verify_identity(builtin_path("base")) == record
    assert ModelRef("builtin:base").tokenizer_spec() == "synthetic"


def test_init_from_the_base_with_another_tokenizer_of_the_same_size_is_refused(
        other_tokenizer, tmp_path):
    """Case 1: it trained (loss 4.41 vs 2.76): only the vocabulary size was compared."""
    with pytest.raises(ValueError, match="model.init_from '.*assets/base' was trained with "
                                         "tokenizer 'synthetic'.*Use the same tokenizer"):
        train_sft(load_config(os.path.join(ROOT, "opd_jax/configs/sft.py:tiny"), [
            f"--config.tokenizer={other_tokenizer}", "--config.model.init_from=builtin:base",
            "--config.train.steps=2"]), str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


def _corrupt_embedding(folder):
    """Zero the first 64 floats of model.safetensors' first tensor (finite: no NaN check
    can see it), in place."""
    import json
    import struct
    file = os.path.join(folder, "model.safetensors")
    with open(file, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        f.seek(8 + n + start)
        f.write(b"\0" * 256)


def test_a_shipped_base_with_finite_corruption_is_refused(tmp_path):
    """Case 2: the base with an embedding zeroed loaded and evaluated 0.000 everywhere; no
    hash of the shipped weights was checked."""
    import shutil

    from opd_jax.models import ModelRef, load_pretrained
    from opd_jax.models.builtin import builtin_path
    copy = tmp_path / "base"
    shutil.copytree(builtin_path("base"), copy)
    load_pretrained(str(copy))                      # intact: loads
    _corrupt_embedding(copy)
    for load in (lambda: load_pretrained(str(copy)), lambda: ModelRef(str(copy)).load()):
        with pytest.raises(ValueError, match=f"{copy}/model.safetensors has sha256 .*, expected "
                                             f".* as recorded in identity.json"):
            load()


def test_an_export_records_its_identity_and_an_edited_config_is_refused(tmp_path):
    import json

    from opd_jax.models import ModelConfig, load_pretrained, save_pretrained, tokenizer_meta
    from opd_jax.models.identity import read_identity
    from tests.models.helpers import random_model
    out = tmp_path / "export"
    meta = tokenizer_meta("synthetic", synthetic_tokenizer())
    save_pretrained(random_model(ModelConfig.preset("tiny").replace(vocab_size=128)), str(out),
                    tokenizer=meta)
    assert read_identity(out)["tokenizer"] == meta
    load_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3                      # a plausible, silent edit
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json has sha256 .* recorded in identity.json"):
        load_pretrained(str(out))


def test_resume_with_changes_cannot_switch_the_tokenizer(run_copy, other_tokenizer):
    """Case 4: --resume_with_changes switched the tokenizer mid-run (loss 4.92 vs 4.09);
    the run's recorded fingerprint was never compared."""
    from opd_jax.checkpoint import WorkdirError
    from tests.faults.conftest import checkpoint_snapshot
    before = checkpoint_snapshot(run_copy)
    with pytest.raises(WorkdirError, match="trained with tokenizer 'synthetic'.*cannot continue "
                                           "under it \\(not even with --resume_with_changes\\)"):
        train_sft(sft_cfg(f"--config.tokenizer={other_tokenizer}", "--config.train.steps=12"),
                  str(run_copy), progress=False, resume_with_changes=True)
    assert checkpoint_snapshot(run_copy) == before


def test_a_merge_of_models_with_different_tokenizers_is_refused(good_run, other_tokenizer,
                                                                tmp_path):
    from opd_jax.models import ModelRef
    from opd_jax.recipes.pipeline import merge_tokenizer
    other = tmp_path / "other"
    train_sft(sft_cfg(f"--config.tokenizer={other_tokenizer}", "--config.train.steps=1",
                      "--config.train.ckpt_every=1"), str(other), progress=False)
    same = merge_tokenizer([ModelRef(str(good_run[0]))] * 2, "m")
    assert same["spec"] == "synthetic"
    with pytest.raises(ValueError, match="merge stage 'm': its models were trained with "
                                         "different tokenizers"):
        merge_tokenizer([ModelRef(str(good_run[0])), ModelRef(str(other))], "m")
