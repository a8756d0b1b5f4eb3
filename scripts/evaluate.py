"""Validation loss and bits per byte of an export (scripts/export.py) on a split of prepared data.

    python scripts/evaluate.py model.safetensors                         # its run's own validation split
    python scripts/evaluate.py model.safetensors --tokens 32768          # train.py's eval_tokens
    python scripts/evaluate.py model.safetensors data.source='other/*.parquet' data.cache_dir=...

The data config starts from the one of the run that trained the export (kept in the export) and takes
data.* overrides as train.py spells them (no preset groups such as data=fineweb_edu: give their keys).
The data is prepared like train.py does when missing, and must be tokenized with the export's tokenizer:
with data.tokenizer=bpe that means the run's own data settings. The loss is eval/loss.py's, over the same
batches as train.py's evaluations, so `--tokens` = the run's eval_tokens repeats its last val_loss.
"""

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from configs.data_schema import DataConfig  # noqa: E402
from configs.schema import ConfigError  # noqa: E402
from data import DataError, PackedLoader, Prepared, prepare  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from eval.loss import evaluate, token_bytes  # noqa: E402
from model.export import ExportInvalid, load_export, read_metadata  # noqa: E402
from run.dist import DistInfo, resolve_device  # noqa: E402


def data_config(meta: dict, overrides: list[str]):
    """The export's run's data config (schema defaults if it has none) with `overrides` applied."""
    keys = [o.split("=", 1)[0] for o in overrides]
    bad = [o for o, k in zip(overrides, keys, strict=True) if "=" not in o or not k.startswith("data.")]
    if bad:
        raise ConfigError(f"only data.KEY=VALUE overrides are taken, not {', '.join(bad)}")
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), meta["extra"].get("data", {}))
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([o.removeprefix("data.") for o in overrides]))
    except OmegaConfBaseException as err:
        raise ConfigError(f"data overrides {' '.join(overrides)}: {err}") from None


def open_data(export: Path, meta: dict, cfg) -> Prepared:
    """The prepared data of `cfg`, built when missing, which must be tokenized with the export's tokenizer."""
    enc = tok.from_json(meta["tokenizer"])
    # Cheap first: settings that give another tokenizer can never match, so no preparing them.
    if cfg.tokenizer != enc.name:
        raise DataError(
            f"data.tokenizer={cfg.tokenizer} cannot tokenize like {export}, whose tokenizer is {enc.name}"
        )
    run = meta["extra"].get("data")
    changed = [k for k in ("vocab_size", "tokenizer_max_chars") if run is not None and cfg[k] != run[k]]
    if cfg.tokenizer == "bpe" and changed:
        raise DataError(
            f"{', '.join(f'data.{k}={cfg[k]}' for k in changed)}: a BPE trained with other settings than "
            f"{export}'s run ({', '.join(f'{k}={run[k]}' for k in changed)}) is another tokenizer"
        )
    data = prepare(cfg, build=True)
    if tok.to_json(data.tokenizer) != meta["tokenizer"]:
        raise DataError(
            f"{data.folder} is tokenized with {data.tokenizer_id}, not with {export}'s tokenizer: "
            "evaluate on data prepared with the run's data.tokenizer, data.vocab_size and "
            "data.tokenizer_max_chars and its source (with data.tokenizer=bpe, the tokenizer is trained on "
            "the source)"
        )
    return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("export", type=Path, help="a .safetensors file written by scripts/export.py")
    parser.add_argument("overrides", nargs="*", help="data.KEY=VALUE, as for train.py")
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument("--tokens", type=int, default=0, help="buffer tokens to evaluate; 0: the whole split")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = parser.parse_intermixed_args()  # overrides before or after the options
    try:
        device = resolve_device(args.device)
        meta = read_metadata(args.export)
        cfg = data_config(meta, args.overrides)
        data = open_data(args.export, meta, cfg)
        model, enc, meta = load_export(args.export, device)
        loader = PackedLoader(data, cfg, split=args.split, device=device, infinite=False)
    except (ConfigError, DataError, ExportInvalid) as err:
        sys.exit(f"error: {err}")
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:
        result = evaluate(
            model.token_losses, loader, token_bytes(enc, data.vocab_size), args.tokens or sys.maxsize, info
        )
    loader.close()
    print(
        f"{args.export} (step {meta['step']}) on the {args.split} split of {data.folder}: "
        f"loss {result['val_loss']:.6f}, bits per byte {result['val_bpb']:.6f}"
    )


if __name__ == "__main__":
    main()
