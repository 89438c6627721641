"""One module per step of the study, each a CLI command and an MLflow run. A
step never imports another step: they talk through the record and the ledger."""
