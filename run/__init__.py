"""The machinery of a run, next to the training loop (train.py imports from the modules):
- run.preflight: `check_config`, `take_lock`, `find_resume`, everything checked before any data or model
  work;
- run.dist: `init_distributed` (torchrun or one process), `DistInfo`, and the collectives the loop uses;
- run.lock: `RunLock`, one run per run_dir (`RunLocked` names the holder);
- run.stop: `GracefulStop`, a stop after the current step on SIGTERM, SIGINT or SIGUSR1;
- run.parallel: `parallelize` (DDP, alone or with ZeRO optimisers, or FSDP2 around the model, and the
  functions the loop calls),
  `model_state` and `load_model_state` (the model and optimisers by parameter name), `PARALLEL_MODES`;
- run.checkpoint: `Checkpointer` (verified DCP checkpoint folders written by every rank, in the background
  or not, fallback past damaged ones), `load`, `read_tensors`, `read_model_state`, `check_resume`,
  `check_compatible`, `rng_state`, `set_rng_state`;
- run.determinism: `configure_determinism`, the settings behind `deterministic=true`;
- run.files: `write_durably`, `fsync_dir`, the fsyncs behind every atomic write (checkpoints, data shards,
  exports).
"""
