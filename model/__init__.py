"""The GPT, its attention backends and its optimisers.

Public surface, imported from the modules:
- model.gpt: `GPT` (a packed batch in, the loss or the per-token losses out), `GPTShape` (the sizes
  `depth` sets), `layer_windows` (each layer's attention window from `window_pattern`);
- model.attention: `Attention` (one backend, prepared once per batch, attended in every layer), `BACKENDS`,
  `default_backend`, `check_backend`;
- model.optim: `build_optimizers` (Muon + AdamW, or AdamW), `OPTIMIZERS`, `lr_multiplier`, `set_lr`;
- model.fp8: `linear` (x W^T in bf16 or an FP8 mode), `FP8_MODES`, `check_mode`;
- model.export: `save_export`, `load_export` (a trained model as one safetensors file, tokenizer included),
  `ExportInvalid`.
"""
