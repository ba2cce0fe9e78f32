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
