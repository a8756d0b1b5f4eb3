"""Evaluation, sampling, and the metrics a run reports.

Public surface, imported from the modules:
- eval.loss: `evaluate` (validation loss and bits per byte over packed batches), `token_bytes`;
- eval.sample: `generate` (a top-k sample of a prompt's continuation, seeded);
- eval.metrics: `RunLogger` (metrics.jsonl and wandb), `MetricsLogError`, `attention_flops`, `peak_flops`.
"""
