"""Write the first batches of rank 0 to an .npz file, and print what they hold.

    python scripts/inspect_data.py +batches=4 +out=batches.npz [+world_size=8] [data overrides]

Arrays: input_ids, targets, cu_seqlens, position_ids (shape [batches, ...]), max_seqlen and bos_id.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
import numpy as np  # noqa: E402

from configs.schema import register_configs  # noqa: E402
from data import DataError, PackedLoader, prepare  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg) -> None:
    count, out = int(cfg.get("batches", 4)), Path(cfg.get("out", "batches.npz"))
    try:
        prepared = prepare(cfg.data, build=True)
        loader = PackedLoader(prepared, cfg.data, world_size=int(cfg.get("world_size", 1)), seed=cfg.seed)
    except DataError as err:
        sys.exit(f"error: {err}")
    batches = [next(loader) for _ in range(count)]
    loader.close()
    arrays = {
        key: np.stack([getattr(b, key).numpy() for b in batches])
        for key in ("input_ids", "targets", "cu_seqlens", "position_ids")
    }
    np.savez(out, **arrays, max_seqlen=np.int64(cfg.data.max_seqlen), bos_id=np.int64(prepared.bos_id))
    enc = prepared.tokenizer
    for i, b in enumerate(batches):
        cu = b.cu_seqlens.tolist()
        lengths = [e - s for s, e in zip(cu, cu[1:], strict=False) if e > s]
        loss = (b.targets >= 0).float().mean().item()
        print(f"batch {i}: {len(lengths)} segments {lengths}, {loss:.1%} of tokens carry a loss")
        for s, e in zip(cu, cu[1:], strict=False):
            if e > s and b.targets[s] >= 0:
                head = enc.decode(b.input_ids[s : min(e, s + 12)].tolist())
                print(f"  [{s:>6}, {e:>6}) {head!r}")
    print(f"wrote {count} batches to {out}")


if __name__ == "__main__":
    main()
