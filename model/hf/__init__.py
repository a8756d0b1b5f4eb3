"""The model as transformers code (scripts/export_hf.py copies these files next to the weights). They import
only torch and transformers: they run from the exported folder, where this package is not installed."""
