"""The GPT, its attention backends and its optimisers."""
