"""The CORE metric of the DCLM paper (arXiv 2406.11794), as nanochat reports it: 22 in-context tasks,
few-shot prompts, each task's accuracy centred by its random baseline, averaged.

The eval bundle (core.yaml, eval_meta_data.csv, eval_data/*.jsonl) is read from a local folder, the
`core.bundle_dir` key; users download it once (BUNDLE_URL). Three kinds of task:

- multiple_choice: one prompt per choice, `query + delimiter + choice`; the choices share the prompt up to
  where their tokens first differ, and the choice with the lowest mean loss over the rest wins.
- schema: one prompt per context option, `option + delimiter + continuation`; the common tail of their
  tokens (the continuation) is scored, and the option under which it has the lowest mean loss wins.
- language_modeling: `context + delimiter + continuation`, right when greedy decoding gives every
  token of the continuation (argmax of each position's logits).

Few-shot examples (`example + "\\n\\n"` each, before the item) are other items of the same task, drawn
with `random.Random(1234 + item index)`, and `max_per_task` keeps the first items after a shuffle by
`random.Random(1337)`: the seeds and prompt layout of nanochat's CORE, so its prompts and scores carry over.

Every prompt starts with <|bos|>, as training documents do. A prompt longer than the model's max_seqlen
loses tokens on the left; where its scored tokens alone do not fit after one token of context (a long
choice, for a model of short max_seqlen), their first ones are lost too and the rest are scored. All
prompts go through the model as documents of packed buffers (the training batch contract, a fixed shape),
several items per forward. Under torchrun each rank takes items i % world_size of every task and the
correct counts are summed over ranks; every rank runs the same number of forwards (FSDP2's forwards are
collectives), padding with buffers of filler.
"""

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from configs.schema import ConfigError
from data import tokenizer as tok
from run.dist import DistInfo

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
# The fields each task type's items must have, and their types.
ITEM_FIELDS = {
    "multiple_choice": {"query": str, "choices": list, "gold": int},
    "schema": {"context_options": list, "continuation": str, "gold": int},
    "language_modeling": {"context": str, "continuation": str},
}
SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234
# CORE's 22 tasks: DCLM's low-variance set, the icl_tasks of the bundle's core.yaml. A bundle lacking some
# gives the mean over the rest, which does not compare with published CORE scores.
CORE_TASKS = (
    "hellaswag_zeroshot",
    "jeopardy",
    "bigbench_qa_wikidata",
    "arc_easy",
    "arc_challenge",
    "copa",
    "commonsense_qa",
    "piqa",
    "openbook_qa",
    "lambada_openai",
    "hellaswag",
    "winograd",
    "winogrande",
    "bigbench_dyck_languages",
    "agi_eval_lsat_ar",
    "bigbench_cs_algorithms",
    "bigbench_operators",
    "bigbench_repeat_copy_logic",
    "squad",
    "coqa",
    "boolq",
    "bigbench_language_identification",
)
SEQ_MULTIPLE = 64  # buffer sizes the attention kernel takes (data.SEQ_MULTIPLE)


class BundleError(ConfigError):
    """A missing or malformed eval bundle; the message names the file, line or key."""


@dataclass(frozen=True)
class Task:
    label: str
    kind: str  # one of TASK_TYPES
    num_fewshot: int
    delimiter: str
    random_baseline: float  # accuracy of guessing, in percent
    items: list  # dicts, after the shuffle and max_per_task


@dataclass(frozen=True)
class Prompt:
    """One prompt as a document: tokens [0, end) go in, tokens [start, end) are scored."""

    tokens: list
    start: int
    end: int


@dataclass(frozen=True)
class CoreResult:
    accuracy: dict  # label -> share of items right
    centered: dict  # label -> (accuracy - baseline) / (1 - baseline), baseline as a share
    core: float  # the mean of `centered`

    def metrics(self) -> dict:
        """The keys a run logs: `core` and each task's centred score as `core/<label>`."""
        return {"core": self.core, **{f"core/{label}": v for label, v in self.centered.items()}}


def missing_core_tasks(labels) -> list[str]:
    """CORE's tasks that are not among `labels`."""
    present = set(labels)
    return [t for t in CORE_TASKS if t not in present]


def check_config(cfg) -> None:
    if cfg.max_per_task < 0:
        raise ConfigError(f"core.max_per_task={cfg.max_per_task} must be at least 0 (0: every item)")
    if cfg.batch_tokens <= 0 or cfg.batch_tokens % SEQ_MULTIPLE:
        raise ConfigError(
            f"core.batch_tokens={cfg.batch_tokens} must be a positive multiple of {SEQ_MULTIPLE}"
        )


def load_for_run(cfg) -> list[Task] | None:
    """The tasks of a run with core_every > 0 (None for 0), read at start-up so that a missing or broken
    bundle stops the run before any work."""
    if cfg.core_every < 0:
        raise ConfigError(f"core_every={cfg.core_every} must be at least 0 (0: never)")
    if cfg.core_every and cfg.core.batch_tokens < cfg.data.max_seqlen:
        raise ConfigError(
            f"core.batch_tokens={cfg.core.batch_tokens} must be at least "
            f"data.max_seqlen={cfg.data.max_seqlen}"
        )
    return load_bundle(cfg.core) if cfg.core_every else None


def load_bundle(cfg) -> list[Task]:
    """Every task of the bundle at `cfg.bundle_dir`, its items shuffled and cut to `cfg.max_per_task`,
    checked field by field."""
    check_config(cfg)
    root = Path(cfg.bundle_dir).expanduser()
    if not root.is_dir():
        raise BundleError(
            f"core.bundle_dir={cfg.bundle_dir!r}: no such folder. Download the CORE eval bundle once "
            f"({BUNDLE_URL}), unzip it (it holds eval_bundle/ with core.yaml, "
            "eval_meta_data.csv and eval_data/) and point core.bundle_dir at that eval_bundle folder"
        )
    specs = read_yaml(root / "core.yaml")
    baselines = read_baselines(root / "eval_meta_data.csv")
    tasks = []
    for i, spec in enumerate(specs):
        where = f"{root / 'core.yaml'}: icl_tasks[{i}]"
        if not isinstance(spec, dict):
            raise BundleError(f"{where} is not a mapping")
        label = required(spec, "label", str, where)
        kind = required(spec, "icl_task_type", str, where)
        if kind not in TASK_TYPES:
            raise BundleError(
                f"{where} ({label}): icl_task_type={kind!r} is not one of {', '.join(TASK_TYPES)}"
            )
        shots = spec.get("num_fewshot")
        shots = shots[0] if isinstance(shots, list) and len(shots) == 1 else shots
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise BundleError(
                f"{where} ({label}): num_fewshot must be a count (or a list of one), not {shots!r}"
            )
        delimiter = spec.get("continuation_delimiter", " ")
        if not isinstance(delimiter, str):
            raise BundleError(f"{where} ({label}): continuation_delimiter must be a string")
        if label not in baselines:
            raise BundleError(
                f"{root / 'eval_meta_data.csv'} has no row for task {label!r} (column 'Eval Task')"
            )
        items = read_items(root / "eval_data" / required(spec, "dataset_uri", str, where), kind)
        random.Random(SHUFFLE_SEED).shuffle(items)
        if cfg.max_per_task:
            items = items[: cfg.max_per_task]
        if len(items) <= shots:
            raise BundleError(
                f"task {label} draws {shots} few-shot examples from its other items, so it needs at least "
                f"{shots + 1} items; it has {len(items)} (core.max_per_task={cfg.max_per_task})"
            )
        tasks.append(Task(label, kind, shots, delimiter, baselines[label], items))
    if len({t.label for t in tasks}) < len(tasks):
        raise BundleError(f"{root / 'core.yaml'}: two tasks share a label")
    return tasks


def required(spec: dict, key: str, kind: type, where: str):
    value = spec.get(key)
    if not isinstance(value, kind):
        raise BundleError(f"{where}: {key} must be a {kind.__name__}, not {value!r}")
    return value


def read_yaml(path: Path) -> list:
    if not path.is_file():
        raise BundleError(f"{path} is missing: the eval bundle lists its tasks there")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise BundleError(f"{path} is not valid YAML ({err})") from None
    tasks = doc.get("icl_tasks") if isinstance(doc, dict) else None
    if not isinstance(tasks, list) or not tasks:
        raise BundleError(f"{path} must hold a non-empty list under the key icl_tasks")
    return tasks


def read_baselines(path: Path) -> dict:
    """Task label -> its random baseline in percent, from the columns 'Eval Task' and 'Random baseline'."""
    if not path.is_file():
        raise BundleError(f"{path} is missing: the eval bundle keeps each task's random baseline there")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for line, row in enumerate(rows, start=2):
        if "Eval Task" not in row or "Random baseline" not in row:
            raise BundleError(f"{path} needs the columns 'Eval Task' and 'Random baseline'")
        try:
            baseline = float(row["Random baseline"])
        except (TypeError, ValueError):
            raise BundleError(
                f"{path} line {line}: Random baseline {row['Random baseline']!r} is not a number"
            ) from None
        if not 0 <= baseline < 100:
            raise BundleError(f"{path} line {line}: Random baseline {baseline} must lie in [0, 100)")
        out[row["Eval Task"]] = baseline
    return out


def read_items(path: Path, kind: str) -> list:
    if not path.is_file():
        raise BundleError(f"{path} is missing (a dataset_uri of core.yaml)")
    items = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as err:
                raise BundleError(f"{path} line {line} is not JSON ({err})") from None
            check_item(item, kind, f"{path} line {line}")
            items.append(item)
    if not items:
        raise BundleError(f"{path} holds no items")
    return items


def check_item(item, kind: str, where: str) -> None:
    if not isinstance(item, dict):
        raise BundleError(f"{where}: an item must be a JSON object")
    for key, kind_of in ITEM_FIELDS[kind].items():
        value = item.get(key)
        if not isinstance(value, kind_of) or isinstance(value, bool):
            raise BundleError(f"{where}: a {kind} item needs {key} ({kind_of.__name__}), got {value!r}")
    options = item.get("choices", item.get("context_options"))
    if options is not None:
        if len(options) < 2 or not all(isinstance(o, str) for o in options):
            raise BundleError(f"{where}: a {kind} item needs at least two string options")
        if not 0 <= item["gold"] < len(options):
            raise BundleError(f"{where}: gold={item['gold']} is not an index of its {len(options)} options")


# Prompts


def fewshot_examples(task: Task, index: int) -> list:
    if not task.num_fewshot:
        return []
    others = [i for i in range(len(task.items)) if i != index]
    return [task.items[i] for i in random.Random(FEWSHOT_SEED + index).sample(others, task.num_fewshot)]


def render(task: Task, index: int) -> list[str]:
    """The item's prompts: one per choice or context option; for language modelling (context, context
    with continuation). Each few-shot example is followed by a blank line."""
    item, d = task.items[index], task.delimiter
    shots = fewshot_examples(task, index)
    if task.kind == "multiple_choice":
        head = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}\n\n" for ex in shots)
        return [f"{head}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task.kind == "schema":
        head = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}\n\n" for ex in shots)
        return [f"{head}{option}{d}{item['continuation']}" for option in item["context_options"]]
    # Contexts are stripped (some carry trailing spaces), and so is the prompt without its continuation,
    # so that its tokens end where the continuation's begin.
    head = "".join(f"{ex['context'].strip()}{d}{ex['continuation']}\n\n" for ex in shots)
    prompt = f"{head}{item['context'].strip()}{d}"
    return [prompt.strip(), prompt + item["continuation"]]


def common_prefix(seqs: list[list]) -> int:
    n = 0
    for column in zip(*seqs, strict=False):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


def encode(task: Task, index: int, tokenizer, bos_id: int, max_seqlen: int) -> list[Prompt]:
    """The item's prompts as token sequences with their scored spans, left-truncated to max_seqlen (the
    scored span too where it leaves no token of context)."""
    seqs = [[bos_id, *tokenizer.encode_ordinary(p)] for p in render(task, index)]
    shortest = min(len(s) for s in seqs)
    if shortest < 2:
        raise BundleError(f"task {task.label}, item {index} renders an empty prompt: nothing to score")
    # Every sequence keeps at least one scored token, even where one option's tokens are all another's.
    if task.kind == "multiple_choice":
        start = min(common_prefix(seqs), shortest - 1)
        spans = [(start, len(s)) for s in seqs]
    elif task.kind == "schema":
        tail = min(common_prefix([s[::-1] for s in seqs]), shortest - 1)
        spans = [(len(s) - tail, len(s)) for s in seqs]
    else:
        # Only the full prompt goes in. Its continuation starts where its tokens part from the prompt
        # without it: at that prompt's end, unless the tokenizer merged across the boundary.
        full = seqs[1]
        seqs, spans = [full], [(min(common_prefix(seqs), len(full) - 1), len(full))]
    out = []
    for s, (start, end) in zip(seqs, spans, strict=True):
        crop = max(0, len(s) - max_seqlen)
        # A scored token needs the one before it in the window. The item stays in its task (skipping it
        # would change a task's items with max_seqlen), and a run's CORE does not stop on it.
        out.append(Prompt(s[crop:], max(start - crop, 1), end - crop))
    return out


# Scoring


def pack(lengths: list[int], batch_tokens: int, max_docs: int) -> list[range]:
    """Consecutive runs of sequences, each run at most batch_tokens tokens and max_docs sequences."""
    runs, first, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > first and (used + n > batch_tokens or i - first == max_docs):
            runs.append(range(first, i))
            first, used = i, 0
        used += n
    if lengths:
        runs.append(range(first, len(lengths)))
    return runs


def build_batch(seqs: list[Prompt], batch_tokens: int, max_seqlen: int, n_segments: int, bos_id: int):
    """A buffer of the batch contract holding `seqs`, then filler (<|bos|>, no targets) in segments of at
    most max_seqlen; also, per position, the index of the sequence whose scored token it predicts (-1:
    none)."""
    input_ids = torch.full((batch_tokens,), bos_id, dtype=torch.int64)
    targets = torch.full((batch_tokens,), -1, dtype=torch.int64)
    owner = torch.full((batch_tokens,), -1, dtype=torch.int64)
    position_ids = torch.empty(batch_tokens, dtype=torch.int64)
    cu_seqlens = [0]
    for j, s in enumerate(seqs):
        at, n = cu_seqlens[-1], len(s.tokens)
        input_ids[at : at + n] = torch.tensor(s.tokens)
        # Position p predicts token p + 1.
        targets[at + s.start - 1 : at + s.end - 1] = torch.tensor(s.tokens[s.start : s.end])
        owner[at + s.start - 1 : at + s.end - 1] = j
        cu_seqlens.append(at + n)
    while cu_seqlens[-1] < batch_tokens:
        cu_seqlens.append(min(cu_seqlens[-1] + max_seqlen, batch_tokens))
    for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False):
        position_ids[a:b] = torch.arange(b - a)
    cu_seqlens += [batch_tokens] * (n_segments + 1 - len(cu_seqlens))
    return input_ids, position_ids, torch.tensor(cu_seqlens, dtype=torch.int32), targets, owner


@torch.no_grad()
def score(
    model, seqs: list[Prompt], batch_tokens: int, bos_id: int, info: DistInfo
) -> tuple[list[float], list[bool]]:
    """Per sequence: the mean loss (nats) of its scored tokens, and whether greedy decoding gives each of
    them. `model(input_ids, position_ids, cu_seqlens, max_seqlen)` gives logits [T, V]; it runs as many
    times on every rank, on filler once this rank's sequences are done."""
    max_seqlen = model.max_seqlen
    if batch_tokens < max_seqlen:
        raise ConfigError(
            f"core.batch_tokens={batch_tokens} must be at least the model's max_seqlen={max_seqlen}"
        )
    # A fixed number of segments, so that every buffer has the same shapes (no recompiles): sequences of
    # 16 tokens or more fill a buffer before the cap, and filler needs a segment per max_seqlen.
    max_docs = batch_tokens // 16
    n_segments = max_docs + math.ceil(batch_tokens / max_seqlen)
    runs = pack([len(s.tokens) for s in seqs], batch_tokens, max_docs)
    device, losses, greedy = info.device, [], []
    for i in range(forward_count(len(runs), info)):
        part = [seqs[j] for j in runs[i]] if i < len(runs) else []
        batch = build_batch(part, batch_tokens, max_seqlen, n_segments, bos_id)
        input_ids, position_ids, cu_seqlens, targets, owner = (t.to(device) for t in batch)
        logits = model(input_ids, position_ids, cu_seqlens, max_seqlen)
        if not part:
            continue
        scored = owner >= 0
        logits, targets, owner = logits[scored], targets[scored], owner[scored]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        nats = F.cross_entropy(logits, targets, reduction="none").double()
        misses = (logits.argmax(dim=-1) != targets).double()
        sums = torch.zeros(len(part), dtype=torch.float64, device=device).index_add_(0, owner, nats)
        wrong = torch.zeros(len(part), dtype=torch.float64, device=device).index_add_(0, owner, misses)
        counts = [s.end - s.start for s in part]
        losses += [total / n for total, n in zip(sums.tolist(), counts, strict=True)]
        greedy += [w == 0 for w in wrong.tolist()]
    return losses, greedy


def forward_count(n: int, info: DistInfo) -> int:
    """The largest of the ranks' numbers of forwards."""
    if not info.enabled:
        return n
    count = torch.tensor([n], device=info.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@torch.no_grad()
def evaluate_core(model, tokenizer, tasks: list[Task], batch_tokens: int, info: DistInfo) -> CoreResult:
    """CORE of `model` (see the module's docstring), the same on every rank. Run it under the autocast of
    training; `model` must have `max_seqlen`."""
    bos_id = tokenizer.encode_single_token(tok.BOS)
    mine = [
        (t, i, encode(task, i, tokenizer, bos_id, model.max_seqlen))
        for t, task in enumerate(tasks)
        for i in range(info.rank, len(task.items), info.world_size)
    ]
    seqs = [s for *_, item_seqs in mine for s in item_seqs]
    losses, greedy = score(model, seqs, batch_tokens, bos_id, info)
    correct = torch.zeros(len(tasks), dtype=torch.int64)
    at = 0
    for t, i, item_seqs in mine:
        n = len(item_seqs)
        if tasks[t].kind == "language_modeling":
            right = greedy[at]
        else:
            means = losses[at : at + n]
            right = means.index(min(means)) == tasks[t].items[i]["gold"]  # a tie goes to the first
        correct[t] += right
        at += n
    if info.enabled:
        correct = correct.to(info.device)
        dist.all_reduce(correct)
    accuracy, centered = {}, {}
    for task, right in zip(tasks, correct.tolist(), strict=True):
        accuracy[task.label] = right / len(task.items)
        base = 0.01 * task.random_baseline
        centered[task.label] = (accuracy[task.label] - base) / (1.0 - base)
    return CoreResult(accuracy, centered, sum(centered.values()) / len(centered))
