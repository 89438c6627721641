"""coopstudy: a pre-registered, MLflow-tracked study of PowerSGD-compressed
data-parallel fine-tuning against a single-device control."""
