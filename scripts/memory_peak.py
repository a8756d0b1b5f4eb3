"""Where a CUDA memory snapshot's peak goes: replay the caching allocator's recorded history, find the moment
the most bytes were allocated, and group the blocks alive then by the code that allocated them.

    python scripts/memory_peak.py SNAPSHOT.pickle [--top 15] [--device 0] [--root DIR]

SNAPSHOT is what `torch.cuda.memory._dump_snapshot` writes after `_record_memory_history` (scripts/
bench_train.py's `+memory_snapshot=DIR` writes one per rank). Bytes are the sizes the program asked for
(the trace's sizes, as pytorch.org/memory_viz plots them), and a block counts until its free completes: a
block freed while another stream still uses it stays allocated until then. `torch.cuda.max_memory_allocated`
counts the allocator's rounded block sizes and drops a block when its free is requested, so it differs a
little from this peak.

A block's site is the innermost frame of its allocation inside this repository (--root), else the innermost
frame in an inductor-generated file (by its basename and line), else the innermost Python frame. Blocks
allocated before recording began (alive when it began, freed in the trace or still alive at the dump) have
no allocation stack: their site is "allocated before recording".
"""

import argparse
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "allocated before recording"
NO_STACK = "no stack recorded"


@dataclass
class Peak:
    bytes: int
    at: int  # index in the device's trace of the event that reached the peak; -1: before the first event
    events: int  # events in the device's trace
    sites: list[tuple[str, int, int]]  # (site, bytes, blocks) alive at the peak, most bytes first
    largest: list[tuple[str, int]]  # (site, bytes) of each block alive at the peak, largest first


def site(frames: list[dict], root: Path = ROOT) -> str:
    if not frames:
        return NO_STACK
    prefix = str(root).rstrip("/") + "/"
    for f in frames:  # innermost first
        if f["filename"].startswith(prefix):
            return f"{f['filename'][len(prefix) :]}:{f['line']} {f['name']}"
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # a cache dir set by hand need not say torchinductor
    for f in frames:
        if "torchinductor" in f["filename"] or (cache and f["filename"].startswith(cache)):
            return f"{os.path.basename(f['filename'])}:{f['line']}"
    # With C++ stacks recorded, the innermost frames are the allocator's and the unwinder's own.
    f = next((f for f in frames if f["filename"].endswith(".py")), frames[0])
    return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"


def find_peak(snapshot: dict, device: int = 0, root: Path = ROOT) -> Peak:
    """The largest total of allocated bytes on `device` within the snapshot's recorded history, and what
    was alive at that moment."""
    traces = snapshot["device_traces"]
    trace = traces[device] if device < len(traces) else []
    # Blocks alive when recording began, as memory_viz reconstructs them: those freed in the trace without
    # their alloc in it, and those alive at the dump that no alloc in the trace accounts for.
    before = {}  # addr -> bytes
    from_trace = set()
    for e in trace:
        if e["action"] == "alloc":
            from_trace.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in from_trace:
                from_trace.remove(e["addr"])
            else:
                before[e["addr"]] = e["size"]
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            addr = b.get("address", addr)
            # A pending free still holds its memory: its free_completed is not in the trace yet.
            if b["state"] in ("active_allocated", "active_pending_free") and addr not in from_trace:
                before[addr] = b.get("requested_size", b["size"])
            addr += b["size"]

    sizes = dict(before)
    total = sum(sizes.values())
    peak, at = total, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= sizes.pop(e["addr"])
        if total > peak:
            peak, at = total, i

    alive = {addr: (size, BEFORE) for addr, size in before.items()}  # addr -> (bytes, site)
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = (e["size"], site(e.get("frames", []), root))
        elif e["action"] == "free_completed":
            del alive[e["addr"]]
    sites = defaultdict(lambda: [0, 0])
    for size, where in alive.values():
        sites[where][0] += size
        sites[where][1] += 1
    return Peak(
        bytes=peak,
        at=at,
        events=len(trace),
        sites=sorted(((s, b, n) for s, (b, n) in sites.items()), key=lambda x: -x[1]),
        largest=sorted(((where, size) for size, where in alive.values()), key=lambda x: -x[1]),
    )


def summary(peak: Peak, top: int = 15) -> str:
    lines = [
        f"peak {peak.bytes / 1e9:.3f} GB allocated, after event {peak.at} of {peak.events}",
        f"{'GB':>8} {'blocks':>7}  site (top {top})",
    ]
    lines += [f"{b / 1e9:>8.3f} {n:>7}  {s}" for s, b, n in peak.sites[:top]]
    lines.append(f"{'GB':>8}  largest blocks")
    lines += [f"{b / 1e9:>8.3f}  {s}" for s, b in peak.largest[:10]]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=Path, help="a pickle from torch.cuda.memory._dump_snapshot")
    parser.add_argument("--top", type=int, default=15, help="sites to list")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index within the snapshot")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository's path where it was run")
    args = parser.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    print(summary(find_peak(snapshot, args.device, args.root), args.top))


if __name__ == "__main__":
    main()
