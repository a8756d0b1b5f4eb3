"""Tokenize a data source once into token shards (idempotent; train.py does the same when they are missing).

    python scripts/prepare_data.py                                   # embedded default: the stdlib corpus
    python scripts/prepare_data.py data.source='corpus/*.parquet' data.vocab_size=8192
    python scripts/prepare_data.py data=fineweb_edu data.max_docs=2000000 data.num_workers=8

Takes the same overrides as train.py; prints the prepared folder. Re-running with the same inputs does
nothing; changed inputs (files, column, tokenizer or split settings) give a new folder.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402

from configs.schema import register_configs  # noqa: E402
from data import DataError, prepare  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg) -> None:
    try:
        prepared = prepare(cfg.data, build=True)
    except DataError as err:
        sys.exit(f"error: {err}")
    print(prepared.folder)


if __name__ == "__main__":
    main()
