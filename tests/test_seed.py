"""The seed model: a deterministic random init for tiny, the GGUF conversion
for the CPU preset, a local directory or a hub id for the full study."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from coopstudy import cli, config
from coopstudy.inputs.seed import resolve_seed

# The shared seed and prepared-store fixtures (made once per session).


def test_tiny_seed_is_a_deterministic_loadable_random_init(tiny_seed, tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_seed.path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_seed.path)
    assert model.num_parameters() == tiny_seed.parameters
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_key_value_heads) == (64, 2, 2)
    # The SmolLM2 vocabulary and chat format, from the GGUF file.
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>" and model.config.eos_token_id == tokenizer.eos_token_id
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)

    # Made afresh in another workspace: the same weights, byte for byte.
    monkeypatch.setenv("COOPSTUDY_HOME", str(tmp_path / "other"))
    again = resolve_seed(config.load("tiny"))
    assert again.path != tiny_seed.path
    assert (again.sha256, again.parameters) == (tiny_seed.sha256, tiny_seed.parameters)
    reseeded = resolve_seed(config.load("tiny", ["model.init_seed=1"]))
    assert reseeded.sha256 != tiny_seed.sha256 and reseeded.parameters == tiny_seed.parameters


def test_a_local_pretrained_directory_is_used_as_is(tiny_seed):
    cfg = config.load("tiny", ["model.source=pretrained", f"model.name_or_path={tiny_seed.path}"])
    seed = resolve_seed(cfg)
    assert seed.path == tiny_seed.path.resolve()
    assert (seed.sha256, seed.parameters) == (tiny_seed.sha256, tiny_seed.parameters)


def test_a_hub_id_that_cannot_be_fetched_is_one_line_not_a_traceback(capsys):
    code = cli.main(["prepare", "--preset", "tiny", "--set", "model.source=pretrained", "model.name_or_path=coopstudy-tests/no-such-model"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "model.name_or_path: 'coopstudy-tests/no-such-model'" in err


@pytest.mark.slow
def test_the_gguf_package_becomes_a_plain_fp32_checkpoint_once():
    cfg = config.load("smollm2-135m-cpu")
    seed = resolve_seed(cfg)
    saved = json.loads((seed.path / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == "float32"
    assert seed.parameters == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    model = AutoModelForCausalLM.from_pretrained(seed.path)
    assert model.num_parameters() == seed.parameters
    assert AutoTokenizer.from_pretrained(seed.path).eos_token == "<|im_end|>"

    started = time.perf_counter()
    again = resolve_seed(cfg)
    assert (again.path, again.sha256) == (seed.path, seed.sha256)
    assert time.perf_counter() - started < 10, "the conversion must be cached, not redone"
