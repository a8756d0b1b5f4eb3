"""The GPT, its attention backends, its optimisers, and the checkpoint/distributed machinery of a run."""
