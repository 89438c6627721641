"""`select`: commit the two predetermined final candidates, by hash, once."""

from __future__ import annotations

import argparse

from coopstudy import candidates, ledger, tracking
from coopstudy.config import Config

HELP = "commit each arm's final checkpoint as its final candidate (by sha256), once per study"
DESCRIPTION = """\
Reads: the newest FINISHED train run of each arm (control, compressed) made with
this config (tags coopstudy.stage=train, coopstudy.arm, coopstudy.config_sha256),
the checkpoint sha256 and local path it recorded, and the weights on disk.
Writes: two ledger entries (kind candidate, subject <config sha>/<arm>, the
weights' sha256) and a select run tagged coopstudy.candidate.<arm> with each
hash and coopstudy.candidate_run.<arm> with each train run id.
Refuses (exit 2, a FAILED select run on record) when an arm has no finished
train run, when the weights on disk no longer hash to what training recorded,
or when this study's candidates were already selected: the selection is made
once, and the refusal names the first one (its time and select run)."""


def run(cfg: Config, args: argparse.Namespace) -> int:
    with tracking.stage_run(tracking.STAGE_SELECT, cfg) as rec:
        chosen = candidates.select_final(cfg, rec.run_id, ledger.Ledger())
        rec.set_tags(
            {tracking.TAG_CANDIDATE_PREFIX + arm: c.sha256 for arm, c in chosen.items()}
            | {tracking.TAG_CANDIDATE_RUN_PREFIX + arm: c.train_run_id for arm, c in chosen.items()}
        )
    print(f"final candidates of config sha {candidates.study_key(cfg)[:12]} ({cfg.preset}), select run {rec.run_id}:")
    for arm, c in chosen.items():
        print(f"  {arm:<10} sha256 {c.sha256}  train run {c.train_run_id}\n             {c.path}")
    return 0
