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
