"""Stage fingerprints follow the target's weights, not its path or file sizes."""
import shutil

import pytest
from safetensors.torch import load_file, save_file

from drafter.stages import TABLE
import drafter.target_identity as identity
from drafter.config import parse_config
from drafter.stages import datagen
from drafter.target_identity import target_fingerprint


@pytest.fixture
def target_copy(tiny_target, tmp_path):
    path = tmp_path / "target"
    shutil.copytree(tiny_target, path)
    return path


def retrain(path):
    """Same architecture, same file names and sizes, different weights."""
    weights = load_file(path / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_retrained_weights_change_the_fingerprint(target_copy):
    before = target_fingerprint(target_copy)
    size = (target_copy / "model.safetensors").stat().st_size
    retrain(target_copy)
    assert (target_copy / "model.safetensors").stat().st_size == size
    assert target_fingerprint(target_copy) != before


def test_same_content_elsewhere_has_the_same_fingerprint(tiny_target, target_copy):
    assert target_fingerprint(tiny_target) == target_fingerprint(target_copy)


def test_hashes_are_cached_per_file(target_copy, monkeypatch):
    first = target_fingerprint(target_copy)
    monkeypatch.setattr(identity, "hash_file", lambda path: pytest.fail(f"re-hashed {path}"))
    assert target_fingerprint(target_copy) == first


def test_revision_is_trusted_without_hashing(target_copy, monkeypatch):
    monkeypatch.setattr(identity, "hash_file", lambda path: pytest.fail("hashed despite a revision"))
    assert target_fingerprint(target_copy, "abc123") == target_fingerprint("/elsewhere", "abc123")
    assert target_fingerprint(target_copy, "abc123") != target_fingerprint(target_copy, "abc124")


def test_missing_weights_are_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weight files"):
        target_fingerprint(tmp_path)


def test_datagen_output_is_not_reused_for_a_retrained_target(target_copy):
    cfg = parse_config({"target": {"path": str(target_copy)}, "train": {"draft_vocab_size": 64},
                        "dump": {"aux_layer_ids": [0, 1, 2]}})
    before = TABLE.fingerprint("datagen", cfg, {"prepare": "prep"})
    retrain(target_copy)
    assert TABLE.fingerprint("datagen", cfg, {"prepare": "prep"}) != before
