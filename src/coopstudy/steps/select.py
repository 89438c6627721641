"""`select`: commit the two predetermined final candidates, by hash, once."""

from __future__ import annotations

import argparse

from coopstudy.commit import candidates, ledger, require
from coopstudy.config import Config
from coopstudy.record import schema, writer

HELP = "commit each arm's final checkpoint as its final candidate (by sha256), once per plan"
DESCRIPTION = f"""\
Commits the final checkpoint of each arm's training under the plan as that
arm's candidate, once per plan: what evaluate scores and report judges.

Reads: the committed plan of this config (refused if anything it hashes
changed), the first FINISHED train run of each arm (control, compressed)
under that plan (tags {schema.TAG_STAGE}={schema.STAGE_TRAIN}, {schema.TAG_ARM},
{schema.TAG_PLAN}; train refuses an arm that finished under it), the checkpoint sha256 and local path it recorded, and
the weights on disk (where they are gone, brought back first from the train
run's `{schema.ART_CHECKPOINT}` artifact, which must hash the same).
Writes: two ledger entries (kind candidate, subject <plan sha>/<arm>, the
weights' sha256) and a select run tagged with the plan,
{schema.TAG_CANDIDATE_PREFIX}<arm> (each hash) and {schema.TAG_CANDIDATE_RUN_PREFIX}<arm> (each
train run id).
Only a FINISHED train run counts: one interrupted, stopped or killed never does.
Refuses (exit 2, a FAILED select run on record) when an arm has no finished
train run, when the weights on disk no longer hash to what training recorded,
or when this plan's candidates were already selected: the selection is made
once, and the refusal names the first one (its time and select run)."""


def run(cfg: Config, args: argparse.Namespace) -> int:
    with writer.stage_run(schema.STAGE_SELECT, cfg) as rec:
        plan_sha = require.committed_plan(cfg)
        rec.set_tags({schema.TAG_PLAN: plan_sha, schema.TAG_REQUIRES_PREFIX + ledger.PLAN: plan_sha})
        book = ledger.Ledger()
        # Two selects at once: the second waits here, then finds the first's selection.
        with book.locked():
            chosen = candidates.final_candidates(cfg, plan_sha, book)
            # On the record first: a ledger entry is never without its mirror,
            # which later steps compare it with (ledger.Ledger.check_record); during
            # an outage the mirror waits in the outbox, and the check says so.
            rec.set_tags(
                {schema.TAG_CANDIDATE_PREFIX + arm: c.sha256 for arm, c in chosen.items()}
                | {schema.TAG_CANDIDATE_RUN_PREFIX + arm: c.train_run_id for arm, c in chosen.items()}
            )
            candidates.commit(cfg, plan_sha, chosen, rec.run_id, book)
    print(f"final candidates of plan {plan_sha[:12]} ({cfg.preset}), select run {rec.run_id}:")
    for arm, c in chosen.items():
        print(f"  {arm:<10} sha256 {c.sha256}  train run {c.train_run_id}\n             {c.path}")
    return 0
