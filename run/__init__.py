"""The machinery of a run, next to the training loop: torchrun set-up and collectives (`dist`), the
run_dir lock (`lock`), graceful stop on scheduler signals (`stop`), verified checkpoints with fallback
(`checkpoint`) and bitwise-reproducible settings (`determinism`). train.py imports from the modules."""
