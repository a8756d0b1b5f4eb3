"""Document sources: the embedded stdlib corpus, local parquet/jsonl/txt files, a Hub dataset, or files of a
Hub repository by `hf://` path.

A source yields (doc_id, text) in a fixed order. Local files and Hub datasets are read through the
`datasets` library, streaming (nothing is copied into its cache). The embedded default, "stdlib", is
every .py file of the running Python's standard library (site-packages excluded), sorted by relative
path, one file per document, read directly. Its few files with bytes that are not UTF-8 (encoding
tests) decode with U+FFFD in their place, deterministically, and are counted; user files with such
bytes are an error instead, naming the file.

The doc id decides the train/val split through a hash (`is_val`): the relative path for stdlib, the
text itself for other sources, so exact duplicates always land in the same split.
"""

import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from glob import glob
from itertools import takewhile
from pathlib import Path

from data.config import DataError

EXTENSIONS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
# JSON lines compressed as the big public corpora ship them (C4, Dolma, RedPajama): `datasets` decompresses
# them while streaming.
COMPRESSED = (".gz", ".zst")
FORMATS = ".parquet, .jsonl or .json (plain, .gz or .zst) or .txt"
# txt files are read this many per `datasets` call (after a read error, one by one to name the file);
# parquet and jsonl files one at a time, so files with different extra columns can be mixed.
TXT_FILES_PER_READ = 64
ROWS_PER_READ = 256


def is_val(doc_id: str, val_fraction: float) -> bool:
    """Deterministic train/val assignment of one document, by a hash of its id (never its position)."""
    digest = hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


@dataclass
class Source:
    spec: str  # data.source as the user wrote it
    kind: str  # stdlib | parquet | json | text | hub
    text_column: str
    files: list[Path] = field(default_factory=list)
    # A Hub dataset: name, config, split, revision; hf:// files: the path (glob) and their format.
    hub: dict = field(default_factory=dict)
    root: Path | None = None  # stdlib: the folder the relative paths start from
    undecodable: int = 0  # stdlib documents whose invalid UTF-8 bytes became U+FFFD (set while reading)

    @property
    def name(self) -> str:
        """A short, file-name-safe label for the cache folder."""
        if self.kind == "stdlib":
            return "stdlib"
        if self.kind == "hub":  # hf://datasets/<owner>/<name>[@revision]/...: the dataset's name
            raw = self.hub["name"] if "name" in self.hub else self.spec.split("/")[4].split("@")[0]
        else:  # the last path component without glob characters: "corpora/imdb/*.parquet" -> "imdb"
            plain = list(takewhile(lambda part: not _magic(part), Path(self.spec).parts))
            raw = Path(plain[-1]).stem if plain else ""
        label = "".join(c if c.isalnum() or c in "-_." else "-" for c in raw).strip("-.")
        return label[:40] or self.kind

    def fingerprint(self) -> dict:
        """What identifies the content, without reading it: part of the cache key."""
        if self.kind == "hub":
            return {"kind": "hub", **self.hub}
        files = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in self.files]
        digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
        extra = {"python": sys.version.split()[0]} if self.kind == "stdlib" else {"column": self.text_column}
        return {"kind": self.kind, "spec": self.spec, "files": len(files), "files_sha256": digest, **extra}

    def size_hint(self) -> int | None:
        """Number of documents when it is known without reading them (for progress bars)."""
        if self.kind == "stdlib":
            return len(self.files)
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(p).metadata.num_rows for p in self.files)
        return None

    def docs(self) -> Iterator[tuple[str, str | None]]:
        """(doc_id, text) in the source's fixed order; text may be None or empty (the caller skips it)."""
        if self.kind == "stdlib":
            yield from self._stdlib_docs()
        elif self.kind == "hub":
            for text in self._hub_texts():
                yield text or "", text
        else:
            for text in self._local_texts():
                yield text or "", text

    def _stdlib_docs(self) -> Iterator[tuple[str, str]]:
        self.undecodable = 0
        for path in self.files:
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="replace")
                self.undecodable += 1
            yield path.relative_to(self.root).as_posix(), text

    def _local_texts(self) -> Iterator[str | None]:
        step = TXT_FILES_PER_READ if self.kind == "text" else 1
        for i in range(0, len(self.files), step):
            group = self.files[i : i + step]
            try:
                yield from _read_files(self.kind, group, self.text_column)
            except DataError:
                raise
            except Exception as err:
                raise _unreadable(self.kind, group, self.text_column, err) from err

    def _hub_texts(self) -> Iterator[str | None]:
        if "files" in self.hub:
            yield from self._hub_file_texts()
            return
        import datasets

        name = self.hub["name"]
        try:
            ds = datasets.load_dataset(
                name,
                self.hub["config"],
                split=self.hub["split"],
                streaming=True,
                revision=self.hub["revision"],
            )
        except Exception as err:
            raise DataError(
                f"data.source={self.spec!r} is no local file, folder or glob, "
                "and loading it as a Hub dataset "
                f"failed ({type(err).__name__}: {err}). Local sources need an existing path (a .parquet, "
                ".jsonl, .json or .txt file, a folder of them, or a glob); Hub datasets need a network."
            ) from err
        try:
            yield from _texts(ds, self.text_column, f"Hub dataset {name!r}")
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"data.source={self.spec!r}: reading the Hub dataset failed: {err}") from err

    def _hub_file_texts(self) -> Iterator[str | None]:
        import datasets

        kind = self.hub["format"]
        options = {"columns": [self.text_column]} if kind == "parquet" else {}
        if kind == "text":
            options = {"sample_by": "document"}
        try:
            ds = datasets.load_dataset(kind, data_files=self.spec, split="train", streaming=True, **options)
            yield from _texts(ds, self.text_column, self.spec)
        except DataError:
            raise
        except Exception as err:
            raise DataError(
                f"data.source={self.spec!r}: reading these Hub files failed ({type(err).__name__}: {err}); "
                "hf:// paths need a network, and their repository, revision and files must exist"
            ) from err


def open_source(cfg) -> Source:
    """Resolve data.source into a Source; local paths are checked now, Hub datasets and hf:// files when
    first read."""
    spec = cfg.source
    if spec.startswith("hf://"):
        parts = spec.split("/")
        if len(parts) < 6 or parts[2] != "datasets" or file_kind(Path(spec)) is None:
            raise DataError(
                f"data.source={spec!r}: an hf:// source is hf://datasets/<owner>/<name>[@revision]/<path or "
                f"glob> of {FORMATS} files"
            )
        return Source(spec, "hub", cfg.text_column, hub={"files": spec, "format": file_kind(Path(spec))})
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        excluded = {"site-packages", "dist-packages"}
        files = [p for p in root.rglob("*.py") if not excluded & set(p.relative_to(root).parts)]
        files.sort(key=lambda p: p.relative_to(root).as_posix())
        return Source(spec, "stdlib", "text", files=files, root=root)
    if _looks_local(spec):
        files = _local_files(spec)
        return Source(spec, file_kind(files[0]), cfg.text_column, files=files)
    hub = {"name": spec, "config": cfg.hub_config, "split": cfg.hub_split, "revision": cfg.hub_revision}
    return Source(spec, "hub", cfg.text_column, hub=hub)


def _magic(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def file_kind(path: Path) -> str | None:
    """parquet, json or text from a file's name, looking through .gz and .zst on JSON; None for others."""
    if path.suffix in COMPRESSED and len(path.suffixes) > 1 and path.suffixes[-2] in (".json", ".jsonl"):
        return "json"
    return EXTENSIONS.get(path.suffix)


def _looks_local(spec: str) -> bool:
    path = Path(spec).expanduser()
    return _magic(spec) or spec.startswith(("/", ".", "~")) or file_kind(path) is not None or path.exists()


def _local_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if _magic(spec):
        files = [Path(p) for p in glob(str(path), recursive=True) if Path(p).is_file()]
        if not files:
            raise DataError(f"data.source={spec!r}: no file matches this pattern")
    elif path.is_dir():
        files = [p for p in path.rglob("*") if file_kind(p) and p.is_file()]
        if not files:
            raise DataError(f"data.source={spec!r}: the folder holds no {FORMATS} file")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"data.source={spec!r}: no such file or folder")
    files = sorted(p.resolve() for p in files)
    for p in files:
        if file_kind(p) is None:
            raise DataError(f"data.source={spec!r}: {p} is not a {FORMATS} file")
    kinds = sorted({file_kind(p) for p in files})
    if len(kinds) > 1:
        raise DataError(f"data.source={spec!r} mixes file kinds ({', '.join(kinds)}): point it at one kind")
    return files


def _read_files(kind: str, files: list[Path], column: str) -> Iterator[str | None]:
    import datasets

    # `datasets` cannot infer anything from an empty file; a txt one is one empty document.
    empty = [p for p in files if p.stat().st_size == 0]
    yield from [""] * len(empty) if kind == "text" else []
    files = [p for p in files if p not in empty]
    if not files:
        return
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent}/..."
    options = {}
    if kind == "text":
        options = {"sample_by": "document"}  # one document per file, like the stdlib corpus
    elif kind == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(files[0]).names
        if column not in names:
            raise DataError(
                f"data.text_column={column!r} is not a column of {where}; its columns are {names}"
            )
        options = {"columns": [column]}  # read only the text
    ds = datasets.load_dataset(
        kind, data_files=[str(p) for p in files], split="train", streaming=True, **options
    )
    yield from _texts(ds, column, where)


def _texts(ds, column: str, where: str) -> Iterator[str | None]:
    """The text column of a streaming dataset, with a clear error when it is missing or not text."""
    names = ds.column_names
    if names is not None and column not in names:
        raise DataError(f"data.text_column={column!r} is not a column of {where}; its columns are {names}")
    if ds.features is not None and column in ds.features:
        dtype = getattr(ds.features[column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise DataError(
                f"data.text_column={column!r} of {where} holds {dtype or ds.features[column]}, not text"
            )
    for batch in ds.iter(batch_size=ROWS_PER_READ):
        if column not in batch:
            raise DataError(
                f"data.text_column={column!r} is not a column of {where}; its columns are {list(batch)}"
            )
        for text in batch[column]:
            if text is not None and not isinstance(text, str):
                raise DataError(
                    f"data.text_column={column!r} of {where} holds {type(text).__name__}, not text"
                )
            yield text


def _unreadable(kind: str, files: list[Path], column: str, err: Exception) -> DataError:
    """Name the file behind a read error by reading the group's files one at a time."""
    culprit, cause = None, err
    for path in files:
        try:
            for _ in _read_files(kind, [path], column):
                pass
        except DataError as found:
            return found
        except Exception as found:
            culprit, cause = path, found
            break
    text = f"{type(cause).__name__}: {cause}"
    hint = " (the files must be UTF-8 text)" if "utf-8" in text.lower() or "parse" in text.lower() else ""
    where = culprit if culprit is not None else f"one of {len(files)} files from {files[0]}"
    return DataError(f"data.source: cannot read {where}: {text}{hint}")
