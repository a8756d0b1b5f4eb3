"""Block sizes of the attention kernels: the one place where they are chosen, per head dim, per pass, and
per length class of documents (measured on an H200).

A pass may split the documents by length into classes with their own blocks, one launch each: small blocks
waste less on the masked diagonal of short documents, large ones reuse more of each load on long ones.
"""

from typing import NamedTuple

from kernels.common import INTERPRET


class Blocks(NamedTuple):
    m: int  # query rows per block
    n: int  # key rows per block
    warps: int
    stages: int
    # The inner loop's tiles come by TMA (Hopper's tensor memory accelerator, through a descriptor that
    # bounds each document in hardware) instead of per-thread loads, where that measured faster.
    tma: bool = False
    # On Hopper, head dim 64 or 128, causal: the class runs the warp-specialised Gluon kernels of
    # hopper_forward.py and hopper_backward.py instead (a load warp; a warpgroup per 64 query rows in the
    # forward, m = 128 or 192; two warpgroups of n / 2 keys in the dK/dV pass, which also adds up dQ, so that
    # the dQ pass of its documents does not run).
    gluon: bool = False


# Per kernel, (longest document, blocks) classes in increasing length; None is unbounded. Each class is
# one launch over the documents of its lengths: small blocks waste less on the masked diagonal of short
# documents, large ones reuse more of each load on long ones. "dq_stored" (optional) is the dQ pass that
# reads the dS stored by the first dK/dV class (see backward.py): its key blocks are that class's, and its
# query blocks a multiple of that class's, no larger than its key blocks.
Config = dict[str, list[tuple[int | None, Blocks]] | Blocks]


DELTA_ROWS = 64  # rows per program of the delta pass, which only streams O and dO


def block_config(head_dim: int, on_hopper: bool = False) -> Config:
    """Block sizes of the kernels: the one place where they are chosen (measured on an H200). `on_hopper`:
    for a Hopper GPU, which runs the Gluon kernels of the classes that say so."""
    # Interpreter: small, unequal blocks, two classes, TMA in some and pointer loads in others, so that
    # small test buffers exercise every path.
    if INTERPRET:
        return {
            "fwd": [(40, Blocks(16, 16, 4, 1, True)), (None, Blocks(32, 16, 4, 1))],
            "dq": [(24, Blocks(16, 32, 4, 1)), (None, Blocks(32, 16, 4, 1, True))],
            "dkdv": [(56, Blocks(16, 32, 4, 1, True)), (None, Blocks(32, 16, 4, 1))],
            "dq_stored": Blocks(32, 32, 4, 1),
        }
    # On Hopper the Gluon passes take every document, as at head dim 128 below; the dK/dV pass streams query
    # blocks of 128 rows, as many elements as at 128. Against the Triton passes below, the backward measured
    # 8% faster on mix (a) of scripts/bench_attention.py and 13-22% on (c), and 4% slower on (b), whose short
    # documents waste more of the 128-query blocks on the diagonal; six forward stages measured 2% faster
    # than four on (c). Documents longer than 2,048 tokens take forward tiles of 192 queries, three
    # warpgroups sharing each key block (as FlashAttention-4 does at this head dim): the forward measured
    # 6-9% faster on (c) (an H200, an H100); on (a) and (b) such tiles measured 4% and 13% slower.
    if head_dim == 64 and on_hopper:
        return {
            "fwd": [(2048, Blocks(128, 128, 8, 6, True, True)), (None, Blocks(192, 128, 12, 6, True, True))],
            "dq": [(None, Blocks(64, 64, 4, 3))],
            "dkdv": [(None, Blocks(128, 128, 8, 2, False, True))],
        }
    # Head dim 64 has no stored-dS dQ pass: the storing dK/dV config spilled, and its backward measured 29%
    # slower. At 128, splitting the dK/dV classes at 1,024 or 512 instead of 2,048 was 1-7% slower.
    if head_dim <= 64:
        return {
            "fwd": [(2048, Blocks(64, 64, 4, 3, True)), (None, Blocks(128, 64, 4, 3, True))],
            "dq": [(None, Blocks(64, 64, 4, 3))],
            "dkdv": [(None, Blocks(32, 128, 4, 3))],
        }
    # On Hopper the Gluon dK/dV pass takes every document: against the Triton pass that stores the dS of
    # documents of up to 2,048 tokens for a dQ pass of one product, it measured 8% faster on mix (a) of
    # scripts/bench_attention.py, 1% on (b), and 1% and 13% under a 512-token window; splitting the
    # documents between the two at 512 or 1,024 tokens was slower than either. Two forward stages instead
    # of three measured 4-13% slower.
    if head_dim <= 128 and on_hopper:
        return {
            "fwd": [(None, Blocks(128, 128, 8, 3, True, True))],
            "dq": [(None, Blocks(128, 64, 8, 3))],
            "dkdv": [(None, Blocks(64, 128, 8, 2, False, True))],
        }
    if head_dim <= 128:
        return {
            "fwd": [(None, Blocks(128, 128, 8, 3, True))],
            "dq": [(None, Blocks(128, 64, 8, 3))],
            "dkdv": [(2048, Blocks(32, 64, 4, 3, True)), (None, Blocks(64, 128, 8, 2))],
            "dq_stored": Blocks(64, 64, 4, 3),
        }
    return {
        "fwd": [(None, Blocks(64, 64, 4, 2))], "dq": [(None, Blocks(64, 32, 4, 2))],
        "dkdv": [(None, Blocks(32, 64, 4, 2))],
    }
