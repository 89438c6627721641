"""The study's record in MLflow: its names, its store, the outbox that rides out outages, and the one writer."""
