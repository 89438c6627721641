"""`evaluate`: score the seed and both final candidates on the final test and
the retention probes, each model in its own child run."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from typing import Any

from coopstudy import scoring
from coopstudy.commit import budget, candidates, ledger, plan, require
from coopstudy.config import Config
from coopstudy.errors import RefusedError, UserError
from coopstudy.inputs import data
from coopstudy.record import outbox, schema, store, writer
from coopstudy.run import lock

HELP = "score seed, control and compressed on the final test and the retention probes"
DESCRIPTION = f"""\
Scores the seed and both selected candidates on the final test (greedy
generation, verified answers) and on the retention probes (NLL).

Reads: the committed plan of this config (refused if anything it hashes
changed), its selection (ledger entries of kind candidate), the candidates'
checkpoints (where their weights are gone, brought back first from the train
run's `{schema.ART_CHECKPOINT}` artifact, which must hash to the selection), the seed model
and the prepared test and retention files.
Holds the device as `train` does, and refuses while another job holds it.
Refuses (exit 2, a FAILED evaluate run on record) unless both candidates were
selected and their weights still hash to the selection; also on a checkpoint
that cannot be loaded, a tokenizer that differs from the seed's, or an empty
test set; and once the plan has spent its budget.allocation_usd (probes, train
and evaluate runs) or its budget.deadline has passed, where any work passes it.
Writes: an evaluate run tagged with the plan and the candidates it checked,
with the seconds it held the device and their cost ({schema.M_COMPLETE_SECONDS},
{schema.M_DEVICE_SECONDS}, {schema.M_COST_USD}; failed and stopped runs too),
and under it one child run per model (tag {schema.TAG_MODEL} = seed, control or compressed)
with the same metrics ({schema.M_ACCURACY}, {schema.M_ACCURACY_PREFIX}<family>,
{schema.M_RETENTION_NLL}, generation speed) and two tables: {schema.ART_TEST_TABLE} (one
row per case: prompt, output, extracted answer, expected, verifier score,
correct = score 1.0) and {schema.ART_RETENTION_TABLE} (one row per document: target tokens,
NLL sum, mean NLL). A model that an earlier evaluate of the plan scored
before it stopped or failed is not scored again: its child run, the one the
report reads, is named on this run ({schema.TAG_SCORED_BY_PREFIX}<model>).
Generation is greedy with the chat template, batched (evaluate.batch_size),
up to evaluate.max_new_tokens, stopped at the end of turn."""


def run(cfg: Config, args: argparse.Namespace) -> int:
    holder = f"coopstudy evaluate --preset {cfg.preset_argument}"
    with lock.one_process_job(holder) as held, writer.stage_run(schema.STAGE_EVALUATE, cfg) as rec:
        held.note(run_id=rec.run_id)
        start = time.perf_counter()
        try:
            results = _score_all(cfg, rec, held)
        except BaseException:
            # A failed or stopped evaluate held the device too. A failure to record it must not take the error's place.
            with contextlib.suppress(Exception):
                rec.log_metrics(budget.spent_metrics(cfg, 1, time.perf_counter() - start))
            raise
        # What it spent, which the report sets against the plan's budget.
        rec.log_metrics(budget.spent_metrics(cfg, 1, time.perf_counter() - start))
    _print_table(cfg, results, rec.run_id)
    return 0


def _score_all(cfg: Config, rec: writer.Recorder, held: lock.Held) -> dict[str, dict[str, float]]:
    """Check the selection and every model, then score each in its own child run of `rec`."""
    results: dict[str, dict[str, float]] = {}
    plan_sha = require.committed_plan(cfg)
    plan_tags = {schema.TAG_PLAN: plan_sha, schema.TAG_REQUIRES_PREFIX + ledger.PLAN: plan_sha}
    rec.set_tags(plan_tags)
    done = candidates.first_evaluation(cfg, plan_sha)
    if done is not None:
        raise RefusedError(
            f"the models were evaluated under plan {plan_sha[:12]} (evaluate run {done.info.run_id}): an evaluation is made "
            f"once per plan, the first one the screens read; go on: `python -m coopstudy report {cfg.arguments}`"
        )
    # The protocol refuses work that would pass the allocation or the deadline: evaluate is work.
    budget.check_spent(cfg, plan_sha, plan.document(cfg, plan_sha), schema.STAGE_EVALUATE)
    selection = require.selection(cfg, plan_sha, ledger.Ledger())
    rec.set_tags(
        {schema.TAG_CANDIDATE_PREFIX + arm: c.sha256 for arm, c in selection.candidates.items()}
        | {schema.TAG_SELECT_RUN: selection.select_run_id}
    )
    # The seed scored is the one the inputs were made from (and the arms trained from), or a refusal
    # before any scoring: a hub model updated since, or a seed folder edited, is another model.
    prepared, seed = require.seeded_inputs(cfg)
    if not prepared.test:
        raise UserError(f"the final test set in {prepared.folder} is empty; nothing to score")
    if not prepared.retention:
        raise UserError(f"the retention probes in {prepared.folder} are empty; nothing to score")
    models = {schema.MODEL_NAME_SEED: (seed.path, seed.sha256)} | {
        arm: (c.path, c.sha256) for arm, c in selection.candidates.items()
    }
    # Every model is checked before any is scored: a bad candidate should
    # not surface after the seed's minutes of generation.
    tokenizers = {name: scoring.load_tokenizer(path, name) for name, (path, _) in models.items()}
    for name, (path, _) in models.items():
        scoring.check_tokenizer(tokenizers[name], tokenizers[schema.MODEL_NAME_SEED], name)
        scoring.check_weights(path, name)

    files = prepared.manifest["files"]
    read = data.dataset_files(prepared.folder, prepared.manifest, data.EVALUATION_FILES)
    for name, (path, sha) in models.items():
        # An evaluate stopped after scoring this model left its child run: the
        # report reads that one, the first finished, so scoring again would only
        # spend the device on a run the report lists as evidence.
        earlier = candidates.first_model_evaluation(cfg, plan_sha, name, sha)
        if earlier is not None:
            _check_whole(name, earlier)
            rec.set_tags({schema.TAG_SCORED_BY_PREFIX + name: earlier.info.run_id})
            results[name] = dict(earlier.data.metrics)
            _print_scores(name, results[name], f"run {earlier.info.run_id}, an earlier evaluate's: taken, not scored again")
            continue
        tokenizer = tokenizers[name]
        model = scoring.load_model(path, name, tokenizer)
        with writer.stage_run(
            schema.STAGE_EVALUATE,
            cfg,
            run_name=f"evaluate-{name}-{cfg.preset}",
            tags=plan_tags | {schema.TAG_MODEL: name, schema.TAG_CHECKPOINT_SHA: sha},
        ) as child:
            held.note(run_id=child.run_id)
            scored = scoring.score_model(model, tokenizer, prepared.test, prepared.retention, cfg.evaluate, name)
            child.log_inputs(read, context="evaluation")
            # The Models view compares the three, each figure on the file it was measured on.
            child.log_model(
                name, scored.metrics, _measured_on(scored.metrics, files),
                params={schema.MODEL_PARAM_WEIGHTS_SHA: sha, schema.MODEL_PARAM_WEIGHTS: str(path)}, tags={schema.TAG_MODEL: name},
            )
            child.log_table(scored.cases, schema.ART_TEST_TABLE)
            child.log_table(scored.retention, schema.ART_RETENTION_TABLE)
        results[name] = scored.metrics
        _print_scores(name, scored.metrics, f"run {child.run_id}")
        del model
        gc.collect()
    return results


def _check_whole(name: str, run: Any) -> None:
    """Refuse an earlier evaluation that ended FINISHED without all of its
    record (what an outage kept back, or the server refused): the report reads it."""
    run_id = run.info.run_id
    lacks = [m for m in (schema.M_ACCURACY, schema.M_GENERATE_ITEMS_PER_SECOND, schema.M_EVAL_THREADS) if m not in run.data.metrics]
    lacks += [t for t in (schema.ART_TEST_TABLE, schema.ART_RETENTION_TABLE) if not store.has_artifact(run_id, t)]
    if lacks:
        waits = outbox.outbox_file(run_id).exists()
        raise RefusedError(
            f"model {name}: its first finished evaluation, run {run_id}, which the report reads, lacks {', '.join(lacks)}",
            hint=f"deliver what waits of it: `python -m coopstudy remote deliver {run_id}`" if waits else None,
        )


def _print_scores(name: str, m: dict[str, float], where: str) -> None:
    print(
        f"{name:<10} accuracy {m[schema.M_ACCURACY]:.3f}  retention NLL {m.get(schema.M_RETENTION_NLL, float('nan')):.4f}  "
        f"{m[schema.M_GENERATE_ITEMS_PER_SECOND]:.2f} cases/s  ({where})",
        flush=True,
    )


def _measured_on(metrics: dict[str, float], files: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """The prepared file each evaluation figure was measured on; the thread count has none."""
    on = {schema.M_RETENTION_NLL: data.RETENTION, schema.M_EVAL_THREADS: None}
    named = {k: on.get(k, data.TEST) for k in metrics}
    return {k: (f, files[f]["sha256"]) for k, f in named.items() if f is not None}


def _print_table(cfg: Config, results: dict[str, dict[str, float]], run_id: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"evaluate {cfg.preset} (run {run_id})")
    families = list(cfg.data.families)
    for header in ("model", "accuracy", *families, "retention NLL", "cases/s", "threads"):
        table.add_column(header, justify="left" if header == "model" else "right")
    for name, m in results.items():
        table.add_row(
            name,
            f"{m[schema.M_ACCURACY]:.3f}",
            *(f"{m[schema.M_ACCURACY_PREFIX + f]:.3f}" if schema.M_ACCURACY_PREFIX + f in m else "-" for f in families),
            f"{m[schema.M_RETENTION_NLL]:.4f}" if schema.M_RETENTION_NLL in m else "-",
            f"{m[schema.M_GENERATE_ITEMS_PER_SECOND]:.2f}",
            f"{int(m[schema.M_EVAL_THREADS])}",
        )
    # Off a terminal rich assumes 80 columns, which would truncate the families' columns.
    Console(width=None if sys.stdout.isatty() else 160).print(table)
