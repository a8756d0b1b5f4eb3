"""Export a checkpoint's model to one safetensors file (model/export.py) that runs with no run_dir or data.

    python scripts/export.py runs/default model.safetensors                          # newest valid one
    python scripts/export.py runs/default/checkpoints/step_000300 model.safetensors  # this one

From a run_dir, the newest checkpoint whose files verify (sizes and sha256) is taken; damaged ones are
skipped with a note, and left as they are (a run may be writing to its run_dir). The tokenizer comes from
the data cache the run trained on, found from the data config in the checkpoint's manifest: that cache must
still be there (scripts/prepare_data.py with the run's data.* settings builds it again).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import DataError  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from model.export import ExportInvalid, find_checkpoint, run_data, save_export  # noqa: E402
from run.checkpoint import CheckpointInvalid, read_model_state  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "source", type=Path, help="a run_dir (its newest valid checkpoint) or a checkpoint folder"
    )
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    args = parser.parse_args()
    try:
        if args.out.is_dir() or not args.out.parent.is_dir():
            raise ExportInvalid(f"{args.out} must be a file path in an existing folder")
        path, manifest = find_checkpoint(args.source)
        data = run_data(path, manifest)
        state = read_model_state(path)
        config, shape = manifest["config"], manifest["shape"]
        extra = {
            "checkpoint": str(path.resolve()),
            "tokenizer_id": data.tokenizer_id,
            "world_size": manifest["world_size"],
            "parallel": manifest.get("parallel"),
            "data": config["data"],  # scripts/eval.py --eval bpb's default: the run's own validation split
        }
        out = save_export(
            args.out,
            state,
            config["model"],
            shape["vocab_size"],
            config["data"]["max_seqlen"],
            tok.to_json(data.tokenizer),
            manifest["step"],
            extra,
        )
    except (CheckpointInvalid, DataError, ExportInvalid) as err:
        sys.exit(f"error: {err}")
    params = sum(t.numel() for t in state.values())
    size = out.stat().st_size
    print(f"wrote {out}: step {manifest['step']} of {path}, {params:,} parameters, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
