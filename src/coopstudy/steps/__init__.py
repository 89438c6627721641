"""One module per step of the study, each a CLI command and an MLflow run. A
step never imports another step: they talk through the record and the ledger."""

from coopstudy.record import schema

ORDER = (
    schema.STAGE_PREPARE, schema.STAGE_VERIFY, schema.STAGE_PROBE, schema.STAGE_PLAN,
    schema.STAGE_TRAIN, schema.STAGE_SELECT, schema.STAGE_EVALUATE, schema.STAGE_REPORT,
)  # fmt: skip
"""The steps in protocol order: each is the module coopstudy.steps.<name>, a
command of the same name and the stage of its runs."""
