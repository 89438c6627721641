"""Choose families and the learning rate on a development split, never on the final test.

    python -m coopstudy dev-split --preset smollm2-135m-cpu [--families F ...] [--lrs 5e-5 1e-4 ...]
                                  [--dev-seed 5000000] [--updates N]

The development split is the final test of another seed: the preset's data
with data.families = --families and data.test_seed = --dev-seed, built as
`prepare` builds it (inputs.data.build: the same task documents and
schedule, questions seen in training or in the study's final test dropped;
tasks.check_development_seed refuses a seed whose range meets the preset's
training, its own or the final test), with replay and retention probes
drawn as `prepare` draws them from the conversations less every topic of
the final retention probes (_development_pool). Nothing of the final test
or the final probes is read or scored: the final test's questions are drawn
again only to be left out.
The seed is scored on it (scoring.score_model: every family's accuracy, the
retention NLL), then, for each learning rate, one control-arm training from
the seed (one process, numerics.update.worker_update over the preset's
schedule, train.updates updates, or --updates) is scored the same way. Beside each trained model,
the study's own screens on the development split: accuracy gain over the
seed and retention (analysis.screens, with the preset's thresholds). The
rule it prints (`choose`, SOLVED and MOVED) and what it writes are in
DESCRIPTION, its `--help`.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from typing import Any

from coopstudy import scoring, ui
from coopstudy.config import COMPRESSED, INT_CEILING, Config
from coopstudy.errors import UserError
from coopstudy.inputs import conversations, data, tasks
from coopstudy.inputs.seed import resolve_seed
from coopstudy.inputs.tasks import DEV_SEED
from coopstudy.record import schema, writer
from coopstudy.run import lock

DEVELOPMENT = "development split"
"""What its progress calls the test set it scores: not the final test."""
SOLVED = 0.5
"""A family the seed already answers this often teaches the study nothing."""
MOVED = 0.10
"""What training must add to a family's accuracy at some rate for the family to be kept."""

HELP = "choose families and the learning rate on a development split (never the final test)"
DESCRIPTION = f"""\
Chooses families and the learning rate on a development split, never on the
final test. The split is built as `prepare` builds the final test, from the
preset's data with data.families = --families and data.test_seed =
--dev-seed (questions seen in training or in the final test dropped); a seed
whose ranges could meet the preset's training, its own training or the final
test is refused.
Its replay and retention probes come from the conversations less every topic
of the final retention probes. Nothing of the final test or of the final
probes is read.

The seed model is scored on the split (each family's accuracy, the retention
NLL). Then, for each learning rate, one control-arm training from the seed
(one process, the preset's schedule, train.updates updates or --updates) is
scored the same way, beside the study's own screens on the split: accuracy
gain over the seed, and retention under the preset's thresholds.

The rule it prints, which the README's measurement followed: keep the
families the seed does not already solve (below {SOLVED:.0%}) and that training moves
by more than {MOVED * 100:.0f} points at some rate; take the largest rate whose retention
bound stays below the threshold.

Writes: the split's prepared folder under <home>/prepared/ (as prepare
        writes one; nothing in the ledger); one MLflow run (stage
        {schema.STAGE_DEV_SPLIT}) with each model's metrics and the
        table as {schema.ART_DEV_SPLIT}. Minutes per rate on CPU: a job of its own,
        for a quiet machine; it holds the device as `train` does, and refuses
        while another job holds it.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coopstudy.cli import add_config_arguments

    add_config_arguments(parser)
    # Given twice, both lists count, as --set's do (argparse kept only the last).
    parser.add_argument("--families", nargs="+", action="extend", default=None, metavar="FAMILY",
                        help="reasoning-gym families to try (default: the preset's data.families)")  # fmt: skip
    parser.add_argument("--lrs", nargs="+", action="extend", type=float, default=None, metavar="LR",
                        help="learning rates to train at (default: 0.5x, 1x, 2x and 4x the preset's train.lr)")  # fmt: skip
    parser.add_argument("--dev-seed", type=int, default=DEV_SEED, help=f"test seed of the development split (default {DEV_SEED:,})")
    parser.add_argument("--updates", type=int, default=None, help="updates of each training (default: train.updates)")


def _dev_config(cfg: Config, families: list[str] | None, dev_seed: int) -> Config:
    from coopstudy import config

    raw = cfg.model_dump(mode="json")
    raw["data"]["test_seed"] = dev_seed
    if families:
        raw["data"]["families"] = families
        raw["data"]["family_options"] = _options_of(cfg, families)
    return config.from_dict(raw)


def _development_pool(cfg: Config) -> conversations.Pool:
    """The conversations a development split draws its replay and retention
    probes from: conversation_pool(cfg) less every topic of `cfg`'s final
    retention probes, so that nothing chosen on the development split (the
    learning rate, by the retention screen) was chosen on a final probe or a
    sibling of one. Refused when too few are left for the split's own."""
    d = cfg.data
    pool = data.conversation_pool(cfg)
    probes, _, _ = data.split_conversations(pool, d.retention_docs, d.replay_docs, d.replay_seed)
    final = {c.group for c in probes}
    kept = [c for c in pool.conversations if c.group not in final]
    where = f"the development split draws its replay and probes outside the {len(final)} topics of the final probes"
    if len(kept) < d.replay_docs + d.retention_docs:
        raise UserError(
            f"data.replay_source: {len(kept)} conversations are left for {d.replay_docs + d.retention_docs}, as {where}; "
            "lower data.replay_docs or data.retention_docs"
        )
    dev_pool = conversations.Pool(kept, pool.info | {"development": f"less the {len(final)} topics of the final retention probes"})
    try:
        data.split_conversations(dev_pool, d.retention_docs, d.replay_docs, d.replay_seed)
    except UserError as err:
        raise UserError(f"{err} ({where})") from None
    return dev_pool


def _options_of(cfg: Config, families: list[str]) -> dict[str, dict]:
    # Options of a family not tried have nothing to apply to.
    return {f: dict(o) for f, o in cfg.data.family_options.items() if f in families}


def _train(cfg: Config, prepared: data.Prepared, seed_path, lr: float, updates: int) -> Any:
    """The control arm's loop, in this process, from the seed: the trained LM."""
    import torch
    from transformers import AutoModelForCausalLM

    from coopstudy.numerics import objective, update
    from coopstudy.numerics.distributed import DistContext

    torch.manual_seed(cfg.train.seed)
    precision = objective.Precision.of(cfg.train.precision)
    lm = precision.cast(AutoModelForCausalLM.from_pretrained(seed_path))
    net = objective.WeightedNLL(lm)
    train = cfg.train.model_copy(update={"lr": lr})
    optimizer = update.build_optimizer(lm.parameters(), train)
    scheduler = update.build_scheduler(optimizer, train.warmup_updates)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    with ui.progress(f"train lr {lr:g}", updates, unit="update", each=True) as advance:
        for k, row in enumerate(prepared.schedule[:updates], start=1):
            result = update.worker_update(
                net, optimizer, scheduler, prepared.train, row, ctx,
                microbatch=cfg.arms.control.microbatch, precision=precision, grad_clip=train.grad_clip,
            )  # fmt: skip
            update.require_finite(result, k)
            advance(loss=f"{result.loss:.4f}")
    return lm.float().eval()


def _frames(scored: dict[str, scoring.Scored]):
    import pandas as pd

    cases = pd.DataFrame([c | {"model": m, "run_id": m} for m, s in scored.items() for c in s.cases])
    retention = pd.DataFrame([r | {"model": m, "run_id": m} for m, s in scored.items() for r in s.retention])
    return cases, retention


def _screens(cfg: Config, seed: scoring.Scored, trained: scoring.Scored) -> tuple[Any, Any]:
    """The study's gain and retention screens for a trained model against the seed."""
    from analysis import screens as sc

    # The screens read the candidate under the compressed arm's name.
    cases, retention = _frames({schema.MODEL_NAME_SEED: seed, COMPRESSED: trained})
    return sc.accuracy_gain(cases, cfg.screens), sc.retention(retention, cfg.screens)


def _per_family(metrics: dict[str, float], families: list[str]) -> dict[str, float]:
    return {f: metrics.get(schema.M_ACCURACY_PREFIX + f, 0.0) for f in families}


def choose(families: list[str], seed_acc: dict[str, float], by_lr: dict[float, dict[str, Any]], threshold: float) -> dict[str, Any]:
    """The README's rule over the measured accuracies and retention bounds."""
    kept = [
        f for f in families
        if seed_acc[f] < SOLVED and any(r["accuracy"][f] - seed_acc[f] > MOVED for r in by_lr.values())
    ]  # fmt: skip
    safe = [lr for lr, r in by_lr.items() if r["retention_bound"] < threshold]
    return {"families": kept, "lr": max(safe) if safe else None}


def check_arguments(cfg: Config, args: argparse.Namespace) -> Config:
    """What dev-split refuses in its arguments, before any work; then the
    development config it trains and scores under (what --dry-run prints)."""
    return _checked(cfg, args)[0]


def _checked(cfg: Config, args: argparse.Namespace) -> tuple[Config, list[float], int, conversations.Pool]:
    """Every refusal of dev-split's arguments; then the development config,
    the learning rates, the updates and the conversations of its replay and probes."""
    lrs = args.lrs or [cfg.train.lr * f for f in (0.5, 1.0, 2.0, 4.0)]
    if any(not (lr > 0 and math.isfinite(lr)) for lr in lrs):
        raise UserError("--lrs: each learning rate must be a positive number")
    twice = sorted({lr for i, lr in enumerate(lrs) if lr in lrs[:i]})
    if twice:
        # The table and the record key each rate by its value: a second training would overwrite the first.
        raise UserError(f"--lrs: {', '.join(f'{lr:g}' for lr in twice)} listed twice")
    if args.dev_seed < 0:
        raise UserError(f"--dev-seed: {args.dev_seed} is negative (reasoning-gym would take its absolute value)")
    if args.dev_seed > INT_CEILING:
        raise UserError(f"--dev-seed: at most {INT_CEILING:,}, as data.test_seed")
    # Checked before the development config is built, which would name a bad family's key data.families.
    families = args.families or list(cfg.data.families)
    tasks.check_families(families, "--families" if args.families else "data.families", _options_of(cfg, families))
    dev = _dev_config(cfg, args.families, args.dev_seed)
    tasks.check_development_seed(cfg.data, dev.data.families, args.dev_seed)
    updates = args.updates if args.updates is not None else dev.train.updates
    if not 1 <= updates <= dev.train.updates:
        raise UserError(f"--updates: between 1 and train.updates ({dev.train.updates}), not {updates}")
    return dev, lrs, updates, _development_pool(cfg)


def run(cfg: Config, args: argparse.Namespace) -> int:
    from rich.table import Table

    dev, lrs, updates, pool = _checked(cfg, args)
    families = list(dev.data.families)
    console = ui.console(120)
    holder = f"coopstudy dev-split --preset {cfg.preset_argument}"
    with lock.one_process_job(holder) as held, writer.stage_run(schema.STAGE_DEV_SPLIT, dev, run_name=f"dev-split-{cfg.preset}") as rec:
        held.note(run_id=rec.run_id)
        seed = resolve_seed(dev)
        tokenizer = scoring.load_tokenizer(seed.path, "seed")
        start = time.perf_counter()
        # Seed ranges apart keep the families' draws apart, not their questions: a family with few
        # distinct ones (gcd up to 5) repeats final-test questions in the split, which would choose by them.
        built = data.build(dev, tokenizer, seed, ui.track, pool=pool, withheld=data.final_test_questions(cfg))
        folder, _ = data.write_prepared(built)
        prepared = data.load_folder(folder, built.digest)
        console.print(
            f"{DEVELOPMENT}: {len(prepared.test)} cases of {', '.join(families)} (test seed {args.dev_seed:,}); "
            f"training {len(prepared.train)} documents, {updates} updates; {len(prepared.retention)} retention probes"
        )
        model = scoring.load_model(seed.path, "seed", tokenizer)
        base = scoring.score_model(model, tokenizer, prepared.test, prepared.retention, dev.evaluate, "seed", DEVELOPMENT)
        del model
        seed_acc = _per_family(base.metrics, families)
        console.print(f"seed: accuracy {base.metrics[schema.M_ACCURACY]:.1%}")
        rec.log_metrics({f"{schema.M_DEV_PREFIX}seed/{k}": v for k, v in base.metrics.items()})

        by_lr: dict[float, dict[str, Any]] = {}
        for lr in lrs:
            lm = _train(dev, prepared, seed.path, lr, updates)
            trained = scoring.score_model(lm, tokenizer, prepared.test, prepared.retention, dev.evaluate, f"lr {lr:g}", DEVELOPMENT)
            del lm
            gc.collect()
            gain, retention = _screens(dev, base, trained)
            by_lr[lr] = {
                "accuracy": _per_family(trained.metrics, families),
                "accuracy_all": trained.metrics[schema.M_ACCURACY],
                "gain": gain.estimate,
                "retention_change": retention.estimate,
                "retention_bound": retention.bound,
            }
            console.print(
                f"lr {lr:g}: accuracy {trained.metrics[schema.M_ACCURACY]:.1%} (gain {gain.estimate * 100:+.1f} pts), "
                f"retention change {retention.estimate:+.4f} nats, bound {retention.bound:+.4f}"
            )
            screens = {"retention_bound": retention.bound, "gain": gain.estimate}
            rec.log_metrics({f"{schema.M_DEV_PREFIX}lr_{lr:g}/{k}": v for k, v in (trained.metrics | screens).items()})
        chosen = choose(families, seed_acc, by_lr, dev.screens.retention_max_nll_increase)

        table = Table(title=f"development split, preset {cfg.preset}: accuracy per family")
        for h in ("family", "seed", *(f"lr {lr:g}" for lr in lrs)):
            table.add_column(h)
        for f in families:
            table.add_row(f, f"{seed_acc[f]:.1%}", *(f"{by_lr[lr]['accuracy'][f]:.1%}" for lr in lrs))
        table.add_row("all", f"{base.metrics[schema.M_ACCURACY]:.1%}", *(f"{by_lr[lr]['accuracy_all']:.1%}" for lr in lrs))
        table.add_row("retention change (nats)", "", *(f"{by_lr[lr]['retention_change']:+.4f}" for lr in lrs))
        table.add_row("retention bound (nats)", "", *(f"{by_lr[lr]['retention_bound']:+.4f}" for lr in lrs))
        console.print(table)
        console.print(
            f"rule: families the seed scores below {SOLVED:.0%} and some rate moves by more than {MOVED * 100:.0f} points: "
            f"{', '.join(chosen['families']) or 'none'}; the largest rate whose retention bound is below "
            f"{dev.screens.retention_max_nll_increase:+.2f} nats: {chosen['lr'] if chosen['lr'] is not None else 'none'}"
        )
        console.print(f"{time.perf_counter() - start:,.0f} s; run {rec.run_id}")
        rec.log_table(
            [{"families": families, "dev_seed": args.dev_seed, "updates": updates, "seed": seed_acc,
              "by_lr": {f"{lr:g}": r for lr, r in by_lr.items()}, "chosen": chosen}],
            schema.ART_DEV_SPLIT,
        )  # fmt: skip
    return 0
