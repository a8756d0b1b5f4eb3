"""Evaluation, sampling, and the metrics a run reports.

Public surface, imported from the modules:
- eval.loss: `evaluate` (validation loss and bits per byte over packed batches), `token_bytes`;
- eval.sample: `generate` (a top-k sample of a prompt's continuation, seeded, on the KV cache),
  `generate_tokens`, `stream_text`;
- eval.core: `load_bundle`, `load_for_run`, `evaluate_core` (the CORE benchmark), `BundleError`;
- eval.metrics: `RunLogger` (metrics.jsonl and wandb), `MetricsLogError`, `attention_flops`, `peak_flops`.
"""
