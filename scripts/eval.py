"""Evaluate a model: the CORE benchmark (eval/core.py) and validation loss and bits per byte (eval/loss.py).

    python scripts/eval.py runs/d24                                     # CORE of the newest checkpoint
    python scripts/eval.py model.safetensors core.max_per_task=100 --json scores.json
    python scripts/eval.py runs/d24 --eval core,bpb --tokens 32768      # both; bpb over 32,768 tokens
    python scripts/eval.py model.safetensors --eval bpb data.source='other/*.parquet' data.cache_dir=...
    torchrun --nproc_per_node=8 scripts/eval.py runs/d24                # ranks share the items and batches

SOURCE is an export (scripts/export.py), a checkpoint folder or a run_dir (its newest checkpoint that
verifies). core.* keys (configs/schema.py's CoreConfig) set the eval bundle's folder, the items per task and
the tokens per forward; the bundle is downloaded once by hand (the error for a missing folder says where
from).

Bits per byte runs on the validation split of the run that trained the model, or on data given by data.*
overrides as train.py spells them (no preset groups such as data=fineweb_edu: give their keys). The data
is prepared like train.py does when missing, and must be tokenized with the model's tokenizer: with
data.tokenizer=bpe that means the run's own data settings. The loss is over the same batches as train.py's
evaluations, so `--tokens` = the run's eval_tokens repeats its last val_loss.
"""

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from configs.data_schema import DataConfig  # noqa: E402
from configs.schema import ConfigError, CoreConfig  # noqa: E402
from data import DataError, PackedLoader, Prepared, prepare  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from eval.core import CORE_TASKS, evaluate_core, load_bundle, missing_core_tasks  # noqa: E402
from eval.loss import evaluate, token_bytes  # noqa: E402
from model.export import ExportInvalid, load_model  # noqa: E402
from run.checkpoint import CheckpointInvalid  # noqa: E402
from run.dist import init_distributed, shutdown, wait_for_rank0  # noqa: E402

EVALS = ("core", "bpb")


def overrides_of(group: str, schema, overrides: list[str], base=None):
    """`schema` (with `base`'s values) and the `group.KEY=VALUE` overrides; an unknown key or a bad value
    is an error naming it."""
    mine = [o.removeprefix(f"{group}.") for o in overrides if o.startswith(f"{group}.")]
    cfg = OmegaConf.merge(OmegaConf.structured(schema), base or {})
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist(mine))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{group} overrides {' '.join(mine)}: {err}") from None


def open_data(source: Path, enc, run_data: dict | None, cfg) -> Prepared:
    """The prepared data of `cfg`, built when missing, which must be tokenized with the model's tokenizer."""
    # Cheap first: settings that give another tokenizer can never match, so no preparing them.
    if cfg.tokenizer != enc.name:
        raise DataError(
            f"data.tokenizer={cfg.tokenizer} cannot tokenize like {source}, whose tokenizer is {enc.name}"
        )
    changed = [k for k in ("vocab_size", "tokenizer_max_chars") if run_data and cfg[k] != run_data[k]]
    if cfg.tokenizer == "bpe" and changed:
        raise DataError(
            f"{', '.join(f'data.{k}={cfg[k]}' for k in changed)}: a BPE trained with other settings than "
            f"{source}'s run ({', '.join(f'{k}={run_data[k]}' for k in changed)}) is another tokenizer"
        )
    data = prepare(cfg, build=True)
    if tok.to_json(data.tokenizer) != tok.to_json(enc):
        raise DataError(
            f"{data.folder} is tokenized with {data.tokenizer_id}, not with {source}'s tokenizer: "
            "evaluate on data prepared with the run's data.tokenizer, data.vocab_size and "
            "data.tokenizer_max_chars and its source (with data.tokenizer=bpe, the tokenizer is trained on "
            "the source)"
        )
    return data


def bits_per_byte(model, enc, meta: dict, args, data_overrides: list[str], info, autocast) -> dict:
    """Validation loss and bits per byte over `args.tokens` buffer tokens of the split (0: all of it)."""
    cfg = overrides_of("data", DataConfig, data_overrides, meta["extra"].get("data"))
    run_data = meta["extra"].get("data")
    data = open_data(args.source, enc, run_data, cfg) if info.is_main else None
    wait_for_rank0(info)
    data = data or open_data(args.source, enc, run_data, cfg)
    loader = PackedLoader(
        data,
        cfg,
        split=args.split,
        rank=info.rank,
        world_size=info.world_size,
        device=info.device,
        infinite=False,
    )
    tokens = args.tokens or sys.maxsize  # 0: the whole split
    with autocast:
        result = evaluate(model.token_losses, loader, token_bytes(enc, data.vocab_size), tokens, info)
    loader.close()
    return {
        "split": args.split,
        "data": str(data.folder),
        "loss": result["val_loss"],
        "bpb": result["val_bpb"],
    }


def report(scores: dict) -> str:
    lines = [f"{scores['source']} (step {scores['step']})"]
    if "core" in scores:
        core = scores["core"]
        width = max(len("CORE"), *map(len, core["accuracy"]))
        lines.append(f"{'task':<{width}}  {'accuracy':>8}  {'centered':>8}")
        for label, acc in core["accuracy"].items():
            lines.append(f"{label:<{width}}  {acc:>8.4f}  {core['centered'][label]:>8.4f}")
        lines.append(f"{'CORE':<{width}}  {'':>8}  {core['core']:>8.4f}")
        if core["missing_tasks"]:
            lines.append(
                f"the bundle lacks {len(core['missing_tasks'])} of CORE's {len(CORE_TASKS)} tasks "
                f"({', '.join(core['missing_tasks'])}): this mean does not compare with full CORE scores"
            )
    if "bpb" in scores:
        b = scores["bpb"]
        lines.append(f"{b['split']} split of {b['data']}: loss {b['loss']:.6f}, bits per byte {b['bpb']:.6f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="an export, a checkpoint folder or a run_dir")
    parser.add_argument("overrides", nargs="*", help="core.KEY=VALUE and data.KEY=VALUE, as for train.py")
    parser.add_argument("--eval", default="core", help="what to evaluate: core, bpb or core,bpb")
    parser.add_argument("--split", choices=("val", "train"), default="val", help="bpb: the split")
    parser.add_argument("--tokens", type=int, default=0, help="bpb: buffer tokens to evaluate; 0: the split")
    parser.add_argument("--json", type=Path, help="also write the scores to this JSON file")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = parser.parse_intermixed_args()  # overrides before or after the options
    evals = args.eval.split(",")
    if not evals or set(evals) - set(EVALS):
        parser.error(f"--eval {args.eval}: give core, bpb or core,bpb")
    if args.tokens < 0:
        parser.error("--tokens must be at least 0")
    info = None
    try:
        bad = [o for o in args.overrides if "=" not in o or not o.startswith(("core.", "data."))]
        if bad:
            raise ConfigError(
                f"only core.KEY=VALUE and data.KEY=VALUE overrides are taken, not {' '.join(bad)}"
            )
        data_overrides = [o for o in args.overrides if o.startswith("data.")]
        for group, needs in (("data", "bpb"), ("core", "core")):
            given = [o for o in args.overrides if o.startswith(f"{group}.")]
            if given and needs not in evals:
                raise ConfigError(f"{' '.join(given)}: {group}.* overrides are for --eval {needs}")
        overrides_of("data", DataConfig, data_overrides)  # unknown keys and bad values, before any work
        core_cfg = overrides_of("core", CoreConfig, args.overrides)
        tasks = load_bundle(core_cfg) if "core" in evals else None  # the bundle is checked before the model
        info = init_distributed(args.device)
        model, enc, meta = load_model(args.source, info.device)
        # As train.py: bf16 autocast on the GPU, fp32 on the CPU.
        cuda = info.device.type == "cuda"
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
        scores = {"source": str(args.source), "step": meta["step"]}
        if tasks is not None:
            with autocast:
                result = evaluate_core(model, enc, tasks, core_cfg.batch_tokens, info)
            scores["core"] = {
                "core": result.core,
                "accuracy": result.accuracy,
                "centered": result.centered,
                "missing_tasks": missing_core_tasks(result.accuracy),
            }
        if "bpb" in evals:
            scores["bpb"] = bits_per_byte(model, enc, meta, args, data_overrides, info, autocast)
    except (ConfigError, DataError, ExportInvalid, CheckpointInvalid) as err:
        sys.exit(f"error: {err}")
    finally:
        if info is not None:
            shutdown(info)
    if info.is_main:
        print(report(scores))
        if args.json:
            args.json.write_text(json.dumps(scores, indent=2) + "\n")


if __name__ == "__main__":
    main()
