"""Evaluation (validation loss, bits per byte), sampling, and the metrics a run reports."""
