"""What is checked before any data or model work: the config (`check_config`), the run_dir lock
(`take_lock`) and the checkpoint to resume from (`find_resume`). Each fails with one error naming the key,
the holder of the lock or the difference, so a bad start costs nothing and leaves nothing behind."""

import warnings
from pathlib import Path

from omegaconf import OmegaConf

from configs.schema import ConfigError
from data.config import check_config as check_data_config
from model.attention import BACKENDS, check_backend
from model.fp8 import check_mode as check_fp8
from model.gpt import GPTShape, layer_windows
from model.optim import OPTIMIZERS
from run.checkpoint import (
    Checkpointer,
    CheckpointInvalid,
    CheckpointMismatch,
    Loaded,
    check_resume,
    load,
    step_of,
)
from run.dist import DistInfo, broadcast_object, wait_for_rank0
from run.lock import RunLock, RunLocked
from run.parallel import check_mode as check_parallel
from run.profiling import check_profile


def check_config(cfg, info: DistInfo) -> None:
    """Every check the config allows before any data, model or checkpoint work."""
    check_data_config(cfg.data)
    check_parallel(cfg.parallel)
    if not cfg.ddp_bucket_mb > 0:
        raise ConfigError(f"ddp_bucket_mb={cfg.ddp_bucket_mb} must be positive")
    micro = cfg.data.tokens_per_micro_batch * info.world_size
    if cfg.total_batch_tokens <= 0 or cfg.total_batch_tokens % micro:
        raise ConfigError(
            f"total_batch_tokens={cfg.total_batch_tokens} must be a positive multiple of "
            f"data.tokens_per_micro_batch * world_size = {micro}"
        )
    for key in ("max_steps", "save_every", "eval_every", "sample_every", "log_every", "keep_last"):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be at least 1")
    if cfg.attention != "auto":
        if cfg.attention not in BACKENDS:
            raise ConfigError(f"attention={cfg.attention!r} must be auto or one of {', '.join(BACKENDS)}")
        check_backend(cfg.attention, info.device)
    if cfg.attention == "sdpa_packed" and cfg.data.tokens_per_micro_batch % cfg.data.max_seqlen:
        raise ConfigError(
            "attention=sdpa_packed cuts the buffer into rows of data.max_seqlen tokens: "
            "data.tokens_per_micro_batch must be a multiple of data.max_seqlen"
        )
    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.optim.name!r} must be one of {', '.join(OPTIMIZERS)}")
    GPTShape.from_config(cfg.model, cfg.data.vocab_size)
    check_fp8(cfg.model, info.device, cfg.data.vocab_size)
    check_profile(cfg.profile, info.device)
    layer_windows(cfg.model.window_pattern, cfg.model.short_window, cfg.model.depth)
    if cfg.wandb.mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} must be online, offline or disabled")
    if cfg.wandb.mode == "online":
        import wandb

        if not wandb.login(verify=False, prompt=False):
            raise ConfigError(
                "wandb.mode=online but no W&B credentials were found: set WANDB_API_KEY, run `wandb login`, "
                "or use wandb.mode=offline (and `wandb sync` later)"
            )


def take_lock(run_dir: Path, info: DistInfo) -> RunLock | None:
    """Rank 0 locks run_dir before anything is written to it; every rank learns whether it did."""
    lock, error = None, None
    if info.is_main:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunLocked as err:
            lock, error = None, str(err)
    error = broadcast_object(error, info)
    if error is not None:
        raise RunLocked(error)
    return lock


def find_resume(cfg, checkpointer: Checkpointer, info: DistInfo) -> Loaded | None:
    """The checkpoint to continue from, verified and checked against the config: `resume=` if given,
    else the newest valid one in run_dir. Rank 0 picks and verifies it (skipping damaged ones), every rank
    loads its run state."""
    picked, error = None, None
    if info.is_main:
        try:
            for orphan in checkpointer.remove_orphans():
                warnings.warn(f"removed {orphan}, left by a save that never finished", stacklevel=1)
            if cfg.resume:
                loaded = load(Path(cfg.resume))
                newer = [p.name for p in checkpointer.all() if step_of(p) > loaded.manifest["step"]]
                if newer:
                    raise CheckpointMismatch(
                        f"resume={cfg.resume} is at step {loaded.manifest['step']}, but run_dir already "
                        f"holds later checkpoints ({', '.join(newer)}): continuing here would mix two "
                        "histories. Use a new run_dir"
                    )
            else:
                loaded = checkpointer.latest_valid()
            if loaded is not None:
                config = OmegaConf.to_container(cfg, resolve=True)
                check_resume(loaded.manifest, config, loaded.path)
                picked = loaded.path
        except (CheckpointInvalid, CheckpointMismatch) as err:
            error = err
    wait_for_rank0(info)  # hashing a large checkpoint's files can outlast a collective's timeout
    error, picked = broadcast_object((error, picked), info)
    if error is not None:
        raise error
    if picked is None:
        return None
    return loaded if info.is_main else load(picked, verify_files=False)
