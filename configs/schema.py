"""The training run's config schema, registered in Hydra's ConfigStore.

YAML files under configs/ only select presets and override fields; every key and its type is
declared here, so an unknown key or a wrong type is rejected at start-up, naming the key.
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from configs.data_schema import DataConfig


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


@dataclass
class ModelConfig:
    depth: int = 2  # the one size dial: width = aspect_ratio * depth, rounded up to head_dim
    aspect_ratio: int = 64
    head_dim: int = 128
    n_kv_heads: int | None = None  # GQA: None means as many K/V heads as query heads
    rope_base: float = 10000.0
    logit_softcap: float = 15.0
    # One letter per layer, repeated over depth: L = full causal context, S = short_window tokens.
    window_pattern: str = "L"
    short_window: int = 256
    # Cross-entropy is computed this many tokens at a time: a chunk's bf16 logits and their gradient (0.5 GB
    # each at 8,192 tokens, vocab 32,768) exist during its pass only, and its head-gradient term
    # ([vocab, width]) is added into one sum as it comes.
    loss_chunk_tokens: int = 8192
    # On Hopper, the MLP's first product and its gradient's run kernels/fused/gemm_hopper.py, with the
    # input's RMSNorm, ReLU^2 and its derivative in their epilogues (kernels/fused/mlp.py); false (or another
    # device) runs cuBLAS plus compiled elementwise kernels.
    fused_mlp: bool = True
    # On Hopper, queries, keys and values are one operator (kernels/fused/qkv.py): q and k from one product
    # of kernels/fused/gemm_hopper.py with RoPE and QK-norm in its epilogue (head_dim dividing 256), and one
    # product each for the three's input and weight gradients; false (or another device) runs cuBLAS plus
    # compiled kernels.
    fused_rope_norm: bool = True
    # On Hopper, attention's output projection adds its product to the residual stream in the epilogue of
    # kernels/fused/gemm_hopper.py's product (kernels/fused/residual.py); false (or another device) runs
    # cuBLAS's addmm, which copies the stream first.
    fused_residual: bool = True
    # FP8 matrix products: none, tensorwise or rowwise. On Hopper, tensorwise with fused_rope_norm,
    # fused_mlp and fused_residual runs those operators' FP8 versions (kernels/fused: rows of the
    # activations and gradients in e4m3, weights per tensor, the scales in the epilogues). Otherwise q/k/v
    # (where fused_rope_norm's bf16 operator does not run), the MLP and the output projection go through
    # torch._scaled_mm (model/fp8.py), per tensor or per row. The LM head's three products (its logits and
    # both gradients) go through torch._scaled_mm in either recipe, a chunk of loss_chunk_tokens at a time:
    # at d20 they are a tenth of the linear layers' FLOPs. The embedding is a lookup.
    fp8: str = "none"
    # With fp8 on, whether the LM head's three products run in it too; false keeps them in bf16, as
    # nanochat's --fp8 does. On an H200 the FP8 head measured faster at d20 and d24 and slower at d12
    # (README, Configuration: FP8).
    fp8_head: bool = True


@dataclass
class OptimConfig:
    name: str = "muon"  # "muon" (Muon for hidden matrices + AdamW for the rest) or "adamw"
    matrix_lr: float = 0.02  # Muon
    muon_momentum: float = 0.95
    embedding_lr: float = 0.2  # AdamW groups; scaled by (width / 768) ** -0.5 as in nanochat
    unembedding_lr: float = 0.004
    adamw_lr: float = 3e-3  # the single learning rate of the "adamw" optimiser
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.8, 0.95)
    eps: float = 1e-10
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    warmup_steps: int = 0
    warmdown_ratio: float = 0.2  # last share of max_steps decays linearly to final_lr_frac
    final_lr_frac: float = 0.0


@dataclass
class WandbConfig:
    mode: str = "disabled"  # online | offline | disabled
    project: str = "varlen-gpt"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class CoreConfig:
    """The CORE benchmark (eval/core.py): scripts/eval.py, and train.py every core_every steps."""

    # The unzipped eval bundle (core.yaml, eval_meta_data.csv, eval_data/), downloaded once by the user.
    bundle_dir: str = "~/.cache/varlen-gpt/eval_bundle"
    max_per_task: int = 0  # items per task, the same ones for every model (a seeded shuffle); 0: all
    # Tokens per packed forward. Its logits ([batch_tokens, vocab] in fp32, 1 GB at 8,192 x 32,768) exist
    # at once; at least data.max_seqlen, a multiple of 64.
    batch_tokens: int = 8192


@dataclass
class ProfileConfig:
    """Profiling a training run (run/profiling.py); every rank writes its own files to run_dir/profile/."""

    # A torch.profiler trace (CPU and CUDA activity) of one step every this many steps; 0: off.
    every: int = 0
    # CUDA: record the caching allocator's history from the first step, and dump it at each profiled step and
    # when a step runs out of memory (pytorch.org/memory_viz, scripts/memory_peak.py). It slows every
    # allocation a little.
    memory_snapshot: bool = False


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    wandb: WandbConfig = field(default_factory=WandbConfig)
    core: CoreConfig = field(default_factory=CoreConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    run_dir: str = "runs/default"
    resume: str | None = None  # a checkpoint path; by default the latest one in run_dir
    max_steps: int = 300
    total_batch_tokens: int = 4096  # tokens per optimiser step, over all ranks and micro-steps
    save_every: int = 100
    keep_last: int = 2  # checkpoints kept in run_dir
    # Write checkpoints in the background (torch.distributed.checkpoint.async_save): a save costs one copy
    # of the state to host memory, and training goes on while a thread writes it. The last save and saves
    # on a stop signal are written before the run moves on.
    async_save: bool = False
    eval_every: int = 100
    # Buffer tokens per evaluation, over all ranks: the held-out pass's first buffers, whole, so the same
    # ones for any number of ranks.
    eval_tokens: int = 32768
    core_every: int = 0  # steps between CORE evaluations (core.*) and at the last step; 0: never
    sample_every: int = 100
    sample_prompt: str = "def "
    sample_tokens: int = 48
    log_every: int = 1  # console progress; a plain line every log_every steps when not on a terminal
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = True
    # How ranks share the work (run/parallel.py): ddp (every rank holds the whole model; gradients are
    # all-reduced in buckets while the backward runs), zero (as ddp, but each rank keeps and steps the
    # optimiser states of its share of the parameters, then broadcasts them; the fastest on 2 and 4 GPUs)
    # or fsdp (FSDP2: weights, gradients and optimiser states sharded over ranks, each block's weights
    # gathered for its forward and backward). With one rank, ddp and zero are the same plain run.
    parallel: str = "zero"
    # fsdp: free each block's gathered weights after its forward and gather them again for the backward
    # (less memory, one more all-gather per block).
    reshard_after_forward: bool = True
    # ddp and zero: the size of DDP's gradient buckets in MB (torch's default, 25). Each bucket's all-reduce
    # starts once its gradients are ready, under the rest of the backward; a bucket larger than the model's
    # gradients makes one all-reduce after the backward, with nothing to hide it.
    ddp_bucket_mb: float = 25.0
    # Under torchrun, a collective that waits this long for another rank fails the job: a hung rank (a
    # stuck GPU, a lost node) ends it rather than holding the allocation. Rank 0's data preparation and
    # checkpoint verification, which the other ranks wait for, are not bound by it (run/dist.py).
    dist_timeout_s: float = 600.0
    # Bitwise-reproducible training: two runs of one config, or a run killed and resumed, give identical
    # losses and weights (torch's deterministic algorithms, inductor without benchmark-picked kernels,
    # a fixed cuBLAS workspace). README "Reproducibility" gives its measured cost.
    deterministic: bool = True
    attention: str = "auto"  # auto | triton | reference | flex | torch_varlen | sdpa_packed | fa4


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema", node=TrainConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="optim", name="schema", node=OptimConfig)
    cs.store(group="core", name="schema", node=CoreConfig)
