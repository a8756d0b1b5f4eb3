"""The ReLU^2 MLP's elementwise work in the epilogue of its matrix products: a persistent, warp-specialised
matmul in Gluon for Hopper.

With h = x W1^T, the MLP's hidden activation is a = relu(h)^2, and its gradient dh = da * 2 relu(h). Since
relu(h) = sqrt(a), the backward needs only a, which the forward keeps in place of h:

    forward:   a  = relu(x W1^T)^2                     (`relu2_matmul`)
    backward:  dh = (g W2) * 2 sqrt(a)     g: the gradient of the MLP's output   (`relu2_grad_matmul`)

With cuBLAS, h is written and read back to write a, and in the backward da is written and read back with h
to write dh: 14 bytes of traffic per hidden activation (bf16), of which these epilogues leave 6.

C = epilogue(A B^T) for A [M, K] and B [N, K], both row-major: B is W1 (an nn.Linear weight) in the forward
and a transposed copy of W2 in the backward. Each program
loops over output tiles of BM x BN (tile t + i * programs). Three partitions:
- a load warp streams the tiles' A and B blocks of BK columns by TMA into a ring of STAGES slots, running
  on into the next tile while the warpgroups finish the last one;
- two warpgroups own 64 of a tile's rows each: they accumulate over K with asynchronous products, keeping
  one in flight, then apply the epilogue and store through shared memory by TMA, whose completion is only
  awaited before the next tile's store.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.6 (the GPU machines) names the TMA copies async_copy_*; later releases async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# Block choice, the one place it is made: 128 x 256 output tiles (two warpgroups of 64 rows; a [64, 256]
# fp32 accumulator is 128 registers a thread), 64 columns of K per ring slot, 3 slots (48 KB each) plus
# 64 KB for the two warpgroups' output tiles.
BM, BN, BK, STAGES = 128, 256, 64, 3
WARPS = 4
# At 168 registers a thread the 384 threads hold the register file, shared out as 240 / 240 / 24.
MAX_REGISTERS = 168
# The epilogues.
RELU2, RELU2_GRAD = gl.constexpr(0), gl.constexpr(1)


@gluon.jit
def _tile_origin(t, n_tiles_n, BM: gl.constexpr, BN: gl.constexpr):
    """Row and column of output tile t; consecutive tiles share their rows of A (in L2 together)."""
    return (t // n_tiles_n) * BM, (t % n_tiles_n) * BN


@gluon.jit
def _load_partition(args):
    """One warp: A and B blocks of every tile of this program, slot after slot of the ring."""
    (a_desc, b_desc, c_desc, g_desc, a_smem, b_smem, c_smem, ready, free, g_ready,
     K, n_tiles, n_tiles_n, EPILOGUE) = args
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    NS: gl.constexpr = a_smem.type.shape[0]
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m0, n0 = _tile_origin(t, n_tiles_n, BM, BN)
        for k0 in range(0, K, BK):
            slot = j % NS
            # A slot's first use waits on phase 1, which a fresh mbarrier counts as complete.
            mbarrier.wait(free.index(slot), ((j // NS) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [m0, k0], ready.index(slot), a_smem.index(slot))
            _tma_load(b_desc, [n0, k0], ready.index(slot), b_smem.index(slot))
            j += 1


@gluon.jit
def _mma_partition(args, WG: gl.constexpr):
    """Warpgroup WG: rows 64 WG .. 64 WG + 63 of each tile, accumulated over K, then the epilogue."""
    (a_desc, b_desc, c_desc, g_desc, a_smem, b_smem, c_smem, ready, free, g_ready,
     K, n_tiles, n_tiles_n, EPILOGUE) = args
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    NS: gl.constexpr = a_smem.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    out = c_smem.index(WG)
    n_k = gl.cdiv(K, BK)
    # The backward loads the forward's activations of a tile into the output buffer at this step of K: late
    # enough for the last tile's store to have left the buffer, early enough to land before the epilogue.
    g_step = gl.minimum(n_k - 1, 2)
    j = 0
    i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m0, n0 = _tile_origin(t, n_tiles_n, BM, BN)
        r0 = m0 + WG * HALF
        acc = gl.zeros([HALF, BN], gl.float32, mma)
        for kk in range(n_k):
            slot = j % NS
            mbarrier.wait(ready.index(slot), (j // NS) & 1)
            a = a_smem.index(slot).slice(WG * HALF, HALF)
            acc = warpgroup_mma(a, b_smem.index(slot).permute((1, 0)), acc, is_async=True)
            # One product stays in flight: the previous one is done reading its slot.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if kk > 0:
                mbarrier.arrive(free.index((j - 1) % NS), count=1)
            if EPILOGUE == RELU2_GRAD:
                if kk == g_step:
                    tma.store_wait(0)
                    mbarrier.expect(g_ready.index(WG), g_desc.block_type.nbytes)
                    _tma_load(g_desc, [r0, n0], g_ready.index(WG), out)
            j += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(free.index((j - 1) % NS), count=1)

        if EPILOGUE == RELU2:
            acc = gl.maximum(acc, 0.0)
            acc = acc * acc
            tma.store_wait(0)  # the last tile's store has read the buffer
        else:
            mbarrier.wait(g_ready.index(WG), i & 1)
            acc = acc * (2.0 * gl.sqrt(out.load(mma).to(gl.float32)))
        out.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [r0, n0], out)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _second_mma_partition(args):
    _mma_partition(args, 1)


@gluon.jit
def _matmul_kernel(a_desc, b_desc, c_desc, g_desc, M, N, K, EPILOGUE: gl.constexpr, STAGES: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    g_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(g_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # both warpgroups read every slot
    n_tiles_n = gl.cdiv(N, BN)
    n_tiles = gl.cdiv(M, BM) * n_tiles_n
    args = (a_desc, b_desc, c_desc, g_desc, a_smem, b_smem, c_smem, ready, free, g_ready,
            K, n_tiles, n_tiles_n, EPILOGUE)
    gl.warp_specialize([
        (_mma_partition, (args, 0)),
        (_second_mma_partition, (args, )),
        (_load_partition, (args, )),
    ], [4, 1], [240, 24])


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these [rows, cols] tensors suit the kernel: a Hopper GPU, 16-bit, row-major with 16-byte
    aligned rows."""
    x = tensors[0]
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    return all(
        t.dtype == x.dtype in (torch.bfloat16, torch.float16)
        and t.dim() == 2
        and t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and t.stride(0) * 2 % 16 == 0
        for t in tensors
    )


def _descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def relu2_matmul(x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """a = relu(x w1^T)^2 for x [M, K] and w1 [N, K]."""
    (M, K), N = x.shape, w1.shape[0]
    if w1.shape[1] != K:
        raise ValueError(f"x {tuple(x.shape)} and w1 {tuple(w1.shape)}: expected [M, K] and [N, K]")
    a = x.new_empty(M, N)
    a_desc = _descriptor(a, [BM // 2, BN])
    _launch(_descriptor(x, [BM, BK]), _descriptor(w1, [BN, BK]), a_desc, a_desc, M, N, K, RELU2)
    return a


def relu2_grad_matmul(g: torch.Tensor, w2_t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """dh = (g w2) * 2 sqrt(a) for g [M, K], w2_t = w2^T [N, K] (row-major, as an nn.Linear weight) and the
    forward's a [M, N]."""
    (M, K), N = g.shape, w2_t.shape[0]
    if w2_t.shape[1] != K or a.shape != (M, N):
        raise ValueError(
            f"g {tuple(g.shape)}, w2_t {tuple(w2_t.shape)}, a {tuple(a.shape)}: "
            "expected [M, K], [N, K], [M, N]"
        )
    dh = g.new_empty(M, N)
    _launch(
        _descriptor(g, [BM, BK]), _descriptor(w2_t, [BN, BK]), _descriptor(dh, [BM // 2, BN]),
        _descriptor(a, [BM // 2, BN]), M, N, K, RELU2_GRAD,
    )
    return dh


def _launch(a_desc, b_desc, c_desc, g_desc, M: int, N: int, K: int, epilogue: gl.constexpr) -> None:
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(n_tiles, torch.cuda.get_device_properties(a_desc.base.device).multi_processor_count)
    _matmul_kernel[(programs,)](
        a_desc, b_desc, c_desc, g_desc, M, N, K, EPILOGUE=epilogue.value, STAGES=STAGES, num_warps=WARPS,
        maxnreg=MAX_REGISTERS,
    )
