"""Structured configs: the dataclasses here are the single source of truth for every knob; the YAML files
only pick presets (configs/model, configs/data, configs/optim).

Public surface: configs.schema's `TrainConfig`, `ModelConfig`, `OptimConfig`, `WandbConfig`, `ConfigError`
and `register_configs` (called once before Hydra composes); configs.data_schema's `DataConfig`.
"""
