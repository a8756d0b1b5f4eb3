"""scripts/memory_peak.py on hand-made snapshots in torch.cuda.memory._snapshot()'s format: blocks alive
before recording began, allocs and frees in the trace, frees that complete after they are requested."""

import pickle

from scripts.memory_peak import BEFORE, NO_STACK, ROOT, find_peak, main, site

GPT = {"filename": str(ROOT / "model" / "gpt.py"), "line": 10, "name": "forward"}
GPT_HEAD = {"filename": str(ROOT / "model" / "gpt.py"), "line": 30, "name": "head"}
INDUCTOR = {"filename": "/tmp/torchinductor_root/ab/cabc123.py", "line": 20, "name": "call"}
TORCH = {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 5, "name": "linear"}
GPT_SITE = "model/gpt.py:10 forward"
INDUCTOR_SITE = "cabc123.py:20"
TORCH_SITE = "torch/nn/functional.py:5 linear"


def event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames), "time_us": 0}


def block(address, size, state, frames=()):
    return {"address": address, "size": size, "requested_size": size, "state": state, "frames": list(frames)}


def segment(address, blocks, device=0):
    total = sum(b["size"] for b in blocks)
    return {"device": device, "address": address, "total_size": total, "stream": 0, "blocks": blocks}


# P1 (100 bytes) and P2 (50) were allocated before recording began: P1 lives on to the dump, P2 is freed in
# the trace. A's free is requested at event 5 but completes only at 7, after D's alloc: the peak, 2050
# bytes, is after event 6. Counted as freed when requested, A would leave a lower peak, later (1900 after 9).
TRACE = [
    event("segment_alloc", 0x1000, 0x10000),
    event("alloc", 0x3000, 1000, [INDUCTOR, TORCH, GPT]),  # 1: A
    event("alloc", 0x4000, 400, [INDUCTOR, TORCH]),  # 2: B
    event("free_requested", 0x2000, 50, [TORCH]),  # 3: P2; the frames of a free are where it was freed
    event("alloc", 0x5000, 300, [TORCH]),  # 4: C
    event("free_requested", 0x3000, 1000, [GPT]),  # 5: A
    event("alloc", 0x6000, 200, [INDUCTOR]),  # 6: D
    event("free_completed", 0x3000, 1000, [GPT]),  # 7: A
    event("free_completed", 0x2000, 50, [TORCH]),  # 8: P2
    event("alloc", 0x3000, 900, [GPT_HEAD]),  # 9: E, at A's address
    event("free_requested", 0x4000, 400),  # 10: B
    event("free_completed", 0x4000, 400),  # 11: B
    event("free_requested", 0x5000, 300),  # 12: C, still pending at the dump
]
BEFORE_BYTES = 100 + 50


def snapshot():
    blocks = [
        block(0x1000, 100, "active_allocated"),  # P1, no stack: allocated before recording
        block(0x1064, 0x1F9C, "inactive"),
        block(0x3000, 900, "active_allocated", [GPT_HEAD]),  # E
        block(0x3384, 0xC7C, "inactive"),  # B's space, free again
        block(0x4000, 400, "inactive"),
        block(0x4190, 0xE70, "inactive"),
        block(0x5000, 300, "active_pending_free", [TORCH]),  # C
        block(0x512C, 0xED4, "inactive"),
        block(0x6000, 200, "active_allocated", [INDUCTOR]),  # D
        block(0x60C8, 0x10000 - 0x60C8 + 0x1000, "inactive"),
    ]
    other_device = segment(0x900000, [block(0x900000, 10**6, "active_allocated")], device=1)
    return {"segments": [segment(0x1000, blocks), other_device], "device_traces": [TRACE, []]}


def test_site_is_the_innermost_repository_frame_then_inductor_then_any_python_frame():
    assert site([INDUCTOR, TORCH, GPT, GPT_HEAD]) == GPT_SITE
    assert site([TORCH, INDUCTOR]) == INDUCTOR_SITE
    cpp = {"filename": "c10/cuda/CUDACachingAllocator.cpp", "line": 1, "name": "malloc"}
    assert site([cpp, TORCH]) == TORCH_SITE
    assert site([cpp]) == "c10/cuda/CUDACachingAllocator.cpp:1 malloc"
    assert site([]) == NO_STACK
    elsewhere = {**GPT, "filename": "/elsewhere/model/gpt.py"}  # the repository where the snapshot was taken
    assert site([TORCH, elsewhere], root="/elsewhere") == GPT_SITE


def test_peak_counts_blocks_until_their_free_completes():
    peak = find_peak(snapshot())
    # The running sum written out: blocks alive before recording, plus allocs, minus completed frees.
    total, best, at = BEFORE_BYTES, BEFORE_BYTES, -1
    for i, e in enumerate(TRACE):
        total += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        if total > best:
            best, at = total, i
    assert (best, at) == (2050, 6)  # by hand: 100 + 50 + 1000 + 400 + 300 + 200
    assert (peak.bytes, peak.at, peak.events) == (2050, 6, len(TRACE))
    # Older snapshots give no block addresses: they follow from the segment's address and the block sizes.
    old = snapshot()
    for seg in old["segments"]:
        for b in seg["blocks"]:
            del b["address"]
    assert find_peak(old) == peak


def test_blocks_alive_at_the_peak_grouped_by_site():
    peak = find_peak(snapshot())
    assert peak.sites == [
        (GPT_SITE, 1000, 1),  # A, alive though its free was requested
        (INDUCTOR_SITE, 600, 2),  # B and D
        (TORCH_SITE, 300, 1),  # C
        (BEFORE, 150, 2),  # P1 and P2, whatever the stack of P2's free
    ]
    assert peak.largest == [
        (GPT_SITE, 1000),
        (INDUCTOR_SITE, 400),
        (TORCH_SITE, 300),
        (INDUCTOR_SITE, 200),
        (BEFORE, 100),
        (BEFORE, 50),
    ]
    assert sum(b for _, b, _ in peak.sites) == peak.bytes


def test_a_peak_before_the_first_event_and_devices_apart():
    """Only frees recorded: the peak is the start, the blocks alive before recording, one of them (Q) still
    waiting for its free to complete at the dump. Device 1's segment is its own: device 0's peak leaves it
    out, and device 1 has only that block."""
    snap = snapshot()
    snap["device_traces"][0] = [
        event("free_requested", 0x2000, 50),
        event("free_completed", 0x2000, 50),
        event("free_requested", 0x1064, 60),
    ]
    p1, q = block(0x1000, 100, "active_allocated"), block(0x1064, 60, "active_pending_free")
    snap["segments"][0]["blocks"] = [p1, q, block(0x10A0, 0xFF60, "inactive")]
    peak = find_peak(snap)
    assert (peak.bytes, peak.at, peak.sites) == (210, -1, [(BEFORE, 210, 3)])
    other = find_peak(snap, device=1)
    assert (other.bytes, other.at, other.sites) == (10**6, -1, [(BEFORE, 10**6, 1)])


def test_main_prints_the_top_sites_and_largest_blocks(tmp_path, capsys):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    main([str(path), "--top", "2"])
    out = capsys.readouterr().out
    assert "peak 0.000 GB allocated, after event 6 of 13" in out
    sites, largest = out.split("largest blocks")
    assert GPT_SITE in sites and INDUCTOR_SITE in sites and TORCH_SITE not in sites  # --top 2
    assert len(largest.strip().splitlines()) == 6 and TORCH_SITE in largest
