"""A tiny CORE eval bundle written by the tests (the layout of the real one), a byte-level tokenizer (one
token per byte, so prompts map to tokens by hand) and a model whose every prediction is known."""

import csv
import json
from pathlib import Path

import tiktoken
import torch
from torch import nn

from data import tokenizer as tok

# Each task: its core.yaml entry, random baseline (percent) and items. `right` is whether the Successor
# model gets the item right (see there), worked out by hand in the comments; the bundle leaves it out.
TASKS = [
    {
        "label": "mc",
        "icl_task_type": "multiple_choice",
        "num_fewshot": [0],
        "baseline": 25.0,
        "items": [
            # Scored after the common prefix "q a": "bcd" (3 hits) against "xyz" (a miss, then 2 hits).
            {"query": "q", "choices": ["abcd", "axyz"], "gold": 0, "right": True},
            # "op" (2 hits) against "qq" (2 misses): the model picks 0.
            {"query": "q", "choices": ["mnop", "mnqq"], "gold": 1, "right": False},
            # "hello" (5 misses) against "fghij" (a miss, then 4 hits).
            {"query": "q", "choices": ["hello", "fghij"], "gold": 1, "right": True},
        ],
    },
    {
        "label": "schema",
        "icl_task_type": "schema",
        "num_fewshot": [1],
        "continuation_delimiter": "",
        "baseline": 50.0,
        "items": [
            # The common tail "bcd" is scored: after "a" its first token is a hit, after "q" a miss.
            {"context_options": ["za", "zq"], "continuation": "bcd", "gold": 0, "right": True},
            # "nop" follows "m" (option 1), but gold is 0.
            {"context_options": ["zk", "zm"], "continuation": "nop", "gold": 0, "right": False},
        ],
    },
    {
        "label": "lm",
        "icl_task_type": "language_modeling",
        "num_fewshot": [2],
        "continuation_delimiter": "",
        "baseline": 0.0,
        "items": [
            {"context": "abc", "continuation": "defg", "right": True},
            # Stripped to "klm", which "nop" continues (unstripped, " " would come before "n").
            {"context": " klm ", "continuation": "nop", "right": True},
            {"context": "uvw", "continuation": "xz", "right": False},  # greedy gives "xy"
            {"context": "012", "continuation": "34", "right": True},
        ],
    },
]


def write_bundle(root: Path, tasks=TASKS) -> Path:
    """core.yaml, eval_meta_data.csv and eval_data/<label>.jsonl under `root`."""
    (root / "eval_data").mkdir(parents=True)
    entries = []
    for task in tasks:
        entry = {k: v for k, v in task.items() if k not in ("baseline", "items")}
        entries.append({**entry, "dataset_uri": f"{task['label']}.jsonl"})
        with open(root / "eval_data" / f"{task['label']}.jsonl", "w") as f:
            for item in task["items"]:
                f.write(json.dumps({k: v for k, v in item.items() if k != "right"}) + "\n")
    (root / "core.yaml").write_text(json.dumps({"icl_tasks": entries}))  # JSON is YAML
    with open(root / "eval_meta_data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Random baseline"])
        for task in tasks:
            writer.writerow([task["label"], "test", task["baseline"]])
    return root


def byte_tokenizer() -> tiktoken.Encoding:
    """Token i is byte i (no merges); <|bos|> is 256."""
    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding(
        "bytes", pat_str=tok.SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={tok.BOS: 256}
    )


class Successor(nn.Module):
    """Predicts byte c + 1 after byte c, whatever came before: logit 8 for it, 0 for every other token. A
    scored token that is its predecessor + 1 is a hit (low loss), any other a miss (loss above 8)."""

    def __init__(self, max_seqlen: int, vocab_size: int = 257):
        super().__init__()
        self.max_seqlen = max_seqlen
        self.calls = 0
        table = torch.zeros(vocab_size, vocab_size)
        table[torch.arange(vocab_size - 1), torch.arange(1, vocab_size)] = 8.0
        self.register_buffer("table", table)

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen):
        self.calls += 1
        return self.table[input_ids]
