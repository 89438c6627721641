"""checkpoint: what is saved loads with from_pretrained, and any changed byte is caught."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from fixtures import fill_disk
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from coopstudy import workspace
from coopstudy.run import checkpoint


@pytest.fixture
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(62)} | {"<unk>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _data_start(path: Path) -> int:
    """Offset of the first tensor byte: after the 8-byte length and the JSON header."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _flip(path: Path, offset: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset] ^= 0x01
    path.write_bytes(bytes(blob))


def test_saved_checkpoint_loads_and_matches(model, tokenizer, tmp_path):
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    weights = saved.folder / workspace.WEIGHTS_FILE
    assert saved.sha256 == workspace.sha256_file(weights)
    assert (saved.folder / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(saved.folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # The tied output matrix is stored once, and verify accepts that.
    with open(weights, "rb") as fh:
        header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    assert "lm_head.weight" not in header and "model.embed_tokens.weight" in header


def test_flipped_byte_fails_the_hash(model, tokenizer, tmp_path):
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    weights = saved.folder / workspace.WEIGHTS_FILE
    _flip(weights, _data_start(weights) + 100)
    with pytest.raises(checkpoint.CheckpointMismatch, match="sha256"):
        checkpoint.verify(saved.folder, model.state_dict(), saved.sha256)


def test_flipped_byte_fails_the_tensor_comparison_even_with_a_matching_hash(model, tokenizer, tmp_path):
    # A byte corrupted while writing is already in the hash taken after the
    # write: the tensor-by-tensor read-back is what catches it.
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    weights = saved.folder / workspace.WEIGHTS_FILE
    _flip(weights, _data_start(weights) + 100)
    with pytest.raises(checkpoint.CheckpointMismatch, match="differs from the trained weights"):
        checkpoint.verify(saved.folder, model.state_dict(), workspace.sha256_file(weights))


def test_unreadable_header_fails_loudly(model, tokenizer, tmp_path):
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    weights = saved.folder / workspace.WEIGHTS_FILE
    _flip(weights, 10)  # inside the JSON header
    with pytest.raises(checkpoint.CheckpointMismatch, match="cannot be read back"):
        checkpoint.verify(saved.folder, model.state_dict(), workspace.sha256_file(weights))


def test_weights_changed_after_saving_are_caught(model, tokenizer, tmp_path):
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    with torch.no_grad():
        model.model.norm.weight[0] += 1.0
    with pytest.raises(checkpoint.CheckpointMismatch, match="model.norm.weight differs"):
        checkpoint.verify(saved.folder, model.state_dict(), saved.sha256)


def test_a_tensor_missing_on_disk_is_caught(model, tokenizer, tmp_path):
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    expected = dict(model.state_dict()) | {"extra.weight": torch.zeros(3)}
    with pytest.raises(checkpoint.CheckpointMismatch, match="lacks 1 trained tensors, e.g. extra.weight"):
        checkpoint.verify(saved.folder, expected, saved.sha256)


def test_a_full_disk_keeps_nothing_of_the_checkpoint(model, tokenizer, small_disk):
    # safetensors says a failed write as its own error, not an OSError: it ended the rank in a traceback.
    fill_disk(small_disk, leave_pages=2)  # room for the small files, not for the weights
    folder = small_disk / "checkpoints" / "run"
    folder.mkdir(parents=True)  # as the worker makes it
    with pytest.raises(checkpoint.CheckpointWriteFailed) as failed:
        checkpoint.save(model, tokenizer, folder)
    assert type(failed.value.__cause__).__name__ == "SafetensorError"  # the weights' write, not a small file's
    assert str(failed.value) == f"cannot write the checkpoint {folder}: No space left on device (ENOSPC); nothing of it was kept"
    assert list((small_disk / "checkpoints").iterdir()) == []  # not the half file, not the temporary folder, not the empty one


def test_an_interrupt_while_writing_keeps_nothing(model, tokenizer, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(errno.EIO, os.strerror(errno.EIO))], ids=["interrupt", "EIO"])
def test_a_failure_after_the_rename_keeps_nothing_either(failure, model, tokenizer, tmp_path, monkeypatch):
    # The folder is whole at its name when its parent's entry is synced: a
    # failure there must take it away too, as it says.
    real_fsync = checkpoint._fsync
    folder = tmp_path / "ckpt"

    def fails_at_the_parent(path):
        if path == tmp_path:
            raise failure
        real_fsync(path)

    monkeypatch.setattr(checkpoint, "_fsync", fails_at_the_parent)
    # An interrupt stays one (exit 130), never taken for a write that failed.
    with pytest.raises(checkpoint.CheckpointWriteFailed if isinstance(failure, OSError) else KeyboardInterrupt) as failed:
        checkpoint.save(model, tokenizer, folder)
    if isinstance(failure, OSError):
        assert str(failed.value).endswith("(EIO); nothing of it was kept")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_is_written_whole_then_named_and_never_over_another(model, tokenizer, tmp_path):
    saved = checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left beside it
    with pytest.raises(checkpoint.CheckpointWriteFailed, match="already holds files; a checkpoint is never written over another"):
        checkpoint.save(model, tokenizer, tmp_path / "ckpt")
    assert workspace.sha256_file(saved.folder / workspace.WEIGHTS_FILE) == saved.sha256
