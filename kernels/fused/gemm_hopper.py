"""Matrix products with the elementwise work that follows them in their epilogue: a persistent,
warp-specialised matmul in Gluon for Hopper, with four epilogues and a plain one.

The ReLU^2 MLP. With h = x W1^T, its hidden activation is a = relu(h)^2, and its gradient dh = da * 2 relu(h).
Since relu(h) = sqrt(a), the backward needs only a, which the forward keeps in place of h:

    forward:   a  = relu(x W1^T)^2                     (`relu2_matmul`)
    backward:  dh = (g W2) * 2 sqrt(a)     g: the gradient of the MLP's output   (`relu2_grad_matmul`)

With cuBLAS, h is written and read back to write a, and in the backward da is written and read back with h
to write dh: 14 bytes of traffic per hidden activation (bf16), of which these epilogues leave 6.
Both take the MLP's input un-normalised, with each row's 1/rms (`Rstd`, [M]): rms_norm(x) W1^T scales the
rows of x W1^T, so the forward scales its accumulator's rows, and the backward scales dh's rows, which makes
dh^T x the gradient of W1 and dh W1 the normalised input's gradient scaled by 1/rms (mlp.py).

Attention's queries and keys (`rope_norm_matmul`): q = rms_norm(rope(x Wq^T)) per head, and k likewise, from
one launch over the output tiles of both (the keys' tiles follow the queries'). A tile of 256 columns holds
whole heads, so its epilogue rotates and normalises them in place: the product's output is rounded to 16
bits into shared memory (as cuBLAS's would be), read back as halves of heads, rotated with each row's cos and
sin and scaled by the head's 1/rms, which also goes to global memory for the backward (qkv.py).

The residual stream's update by a block's output projection (`residual_matmul`): out = r + y W^T. cuBLAS
does it as an addmm, which first copies r into the output (a read and a write of the stream) and then reads
it back in its epilogue; this epilogue reads r once.

Products with B as stored ([K, N]): `matmul`, plain or with the residual epilogue (the MLP's products over
its hidden width, mlp.py: dh W1, and x + a W2^T, the block's update of the stream; plain, at the power
cap of training, 3% faster than cuBLAS's at d20), and `joined_matmul`, [a1 | a2] W for the input gradient of
stacked weights from two gradients that lie apart, where cuBLAS would need a1 and a2 copied side by side
first. Attention's q/k/v operator (qkv.py) takes dx = [dh_qk | dv] [Wq; Wk; Wv] so.

C = epilogue(A B^T) for A [M, K] and B [N, K], both row-major: B is W1 (an nn.Linear weight) in the MLP's
forward, a transposed copy of W2 in its backward, Wq then Wk for queries and keys, the projection's weight
for the residual. The plain products read B as [K, N] instead (the stacked weights as they are stored; the
tensor cores take either major order) and A's columns from two tensors, switching at K1. Each program loops
over output tiles of BM x BN (tile t + i * programs). Three partitions:
- a load warp streams the tiles' A and B blocks of BK columns by TMA into a ring of STAGES slots, running
  on into the next tile while the warpgroups finish the last one;
- two warpgroups own 64 of a tile's rows each: they accumulate over K with asynchronous products, keeping
  one in flight, then apply the epilogue and store through shared memory by TMA, whose completion is only
  awaited before the next tile's store. The epilogues that read a tile of another [M, N] tensor (the MLP's
  a in its backward, the residual) load it by TMA into the output buffer during the K loop.
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

from kernels.common import capability, max_registers, nvmma_layout, sm_count
from kernels.fused.numerics import RMS_EPS

# Triton 3.6 names the TMA copies async_copy_*; later releases async_load / async_store.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# Block choice, the one place it is made: 128 x 256 output tiles (two warpgroups of 64 rows; a [64, 256]
# fp32 accumulator is 128 registers a thread), 64 columns of K per ring slot (128 of FP8 operands: the same
# bytes), 3 slots (48 KB each) plus 64 KB for the two warpgroups' output tiles.
BM, BN, BK, STAGES = 128, 256, 64, 3
BK_FP8 = 128
WARPS = 4
# Two warpgroups and the load warp: 168 registers a thread, shared out as 240 / 240 / 24.
MAX_REGISTERS = max_registers(3)
# The epilogues.
RELU2, RELU2_GRAD, ROPE_NORM, RESIDUAL, PLAIN = (gl.constexpr(e) for e in range(5))
# RMSNorm's epsilon (numerics.py), a constexpr for the jit code.
NORM_EPS = gl.constexpr(RMS_EPS)


@gluon.jit
def _tile(t, n_tiles_n, n_tiles_n1, BM: gl.constexpr, BN: gl.constexpr):
    """Row and column of output tile t and whether it belongs to the second output (the keys' columns of a
    queries-and-keys product); consecutive tiles share their rows of A (in L2 together)."""
    nt = t % n_tiles_n
    second = nt >= n_tiles_n1
    if second:
        nt -= n_tiles_n1
    return (t // n_tiles_n) * BM, nt * BN, second


@gluon.jit
def _load_partition(args, B_KN: gl.constexpr):
    """One warp: A and B blocks of every tile of this program, slot after slot of the ring."""
    (a_desc, a2_desc, b_desc, b2_desc, c_desc, c2_desc, g_desc, a_smem, b_smem, c_smem, ready, free, g_ready,
     Cos, Sin, Rstd, RowScale, WScale, M, N, N2, K, K1, n_tiles, n_tiles_n1, n_tiles_n) = args
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    NS: gl.constexpr = a_smem.type.shape[0]
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m0, n0, second = _tile(t, n_tiles_n, n_tiles_n1, BM, BN)
        for k0 in range(0, K, BK):
            slot = j % NS
            # A slot's first use waits on phase 1, which a fresh mbarrier counts as complete.
            mbarrier.wait(free.index(slot), ((j // NS) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            if k0 < K1:
                tma_load(a_desc, [m0, k0], ready.index(slot), a_smem.index(slot))
            else:
                tma_load(a2_desc, [m0, k0 - K1], ready.index(slot), a_smem.index(slot))
            if B_KN:
                tma_load(b_desc, [k0, n0], ready.index(slot), b_smem.index(slot))
            elif second:
                tma_load(b2_desc, [n0, k0], ready.index(slot), b_smem.index(slot))
            else:
                tma_load(b_desc, [n0, k0], ready.index(slot), b_smem.index(slot))
            j += 1


@gluon.jit
def _rotary_tables(Cos, Sin, r0, M, ROWS: gl.constexpr, HALF_D: gl.constexpr, layout: gl.constexpr):
    """cos and sin [ROWS, HALF_D] of rows r0.. (each token's own angles, gathered by position upstream)."""
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF_D, layout=gl.SliceLayout(0, layout))
    offs = rows[:, None] * HALF_D + cols[None, :]
    inside = rows[:, None] < M
    return gl.load(Cos + offs, mask=inside, other=1.0), gl.load(Sin + offs, mask=inside, other=0.0)


@gluon.jit
def _rope_norm_epilogue(out, cos, sin, Rstd, r0, M, head0, heads, first, n_heads, HEAD_DIM: gl.constexpr,
                        layout: gl.constexpr):
    """The heads of the product tile in `out` (heads head0.. of an output of `heads`) rotated by RoPE
    (halves paired) and RMS-normalised in place, as the model's rms_norm(apply_rotary(.)). Each head's
    1/rms goes to column first + head of Rstd [M, n_heads] for the backward."""
    ROWS: gl.constexpr = out.type.shape[0]
    HALF_D: gl.constexpr = HEAD_DIM // 2
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    for h in gl.static_range(out.type.shape[1] // HEAD_DIM):
        lo = out.slice(h * HEAD_DIM, HALF_D, dim=1)
        hi = out.slice(h * HEAD_DIM + HALF_D, HALF_D, dim=1)
        x1 = lo.load(layout).to(gl.float32)
        x2 = hi.load(layout).to(gl.float32)
        u1 = x1 * cos - x2 * sin
        u2 = x1 * sin + x2 * cos
        rstd = gl.rsqrt((gl.sum(u1 * u1, axis=1) + gl.sum(u2 * u2, axis=1)) / HEAD_DIM + NORM_EPS)
        lo.store((u1 * rstd[:, None]).to(out.dtype))
        hi.store((u2 * rstd[:, None]).to(out.dtype))
        gl.store(Rstd + rows * n_heads + first + head0 + h, rstd, mask=(rows < M) & (head0 + h < heads))


@gluon.jit
def _mma_partition(args, WG: gl.constexpr, EPILOGUE: gl.constexpr, HEAD_DIM: gl.constexpr,
                   SCALE_ROWS: gl.constexpr, SCALE_W: gl.constexpr, B_KN: gl.constexpr):
    """Warpgroup WG: rows 64 WG .. 64 WG + 63 of each tile, accumulated over K, then the epilogue."""
    (a_desc, a2_desc, b_desc, b2_desc, c_desc, c2_desc, g_desc, a_smem, b_smem, c_smem, ready, free, g_ready,
     Cos, Sin, Rstd, RowScale, WScale, M, N, N2, K, K1, n_tiles, n_tiles_n1, n_tiles_n) = args
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    NS: gl.constexpr = a_smem.type.shape[0]
    # A warpgroup product takes 32 bytes of K per row: 16 columns of 16-bit operands, 32 of FP8.
    INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, INSTR_K])
    # Rows of 16-byte vectors for the elementwise epilogue that works on halves of heads.
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    out = c_smem.index(WG)
    n_k = gl.cdiv(K, BK)
    # The tile that the epilogue reads (g_desc's) is loaded into the output buffer at this step of K: late
    # enough for the last tile's store to have left the buffer, early enough to land before the epilogue.
    g_step = gl.minimum(n_k - 1, 2)
    j = 0
    i = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m0, n0, second = _tile(t, n_tiles_n, n_tiles_n1, BM, BN)
        r0 = m0 + WG * HALF
        acc = gl.zeros([HALF, BN], gl.float32, mma)
        for kk in range(n_k):
            slot = j % NS
            mbarrier.wait(ready.index(slot), (j // NS) & 1)
            a = a_smem.index(slot).slice(WG * HALF, HALF)
            # B's block is [BK, BN] as loaded from a [K, N] B, else [BN, BK], read K-major.
            b = b_smem.index(slot) if B_KN else b_smem.index(slot).permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # One product stays in flight: the previous one is done reading its slot.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if kk > 0:
                mbarrier.arrive(free.index((j - 1) % NS), count=1)
            if (EPILOGUE == RELU2_GRAD) or (EPILOGUE == RESIDUAL):
                if kk == g_step:
                    tma.store_wait(0)
                    mbarrier.expect(g_ready.index(WG), g_desc.block_type.nbytes)
                    tma_load(g_desc, [r0, n0], g_ready.index(WG), out)
            j += 1
        # Loads issued before the last product's wait, so that their latency hides behind it.
        if EPILOGUE == ROPE_NORM:
            cos, sin = _rotary_tables(Cos, Sin, r0, M, HALF, HEAD_DIM // 2, rows_layout)
        if SCALE_ROWS:
            rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
            scale = gl.load(RowScale + rows, mask=rows < M, other=0.0)
        if SCALE_W:
            w_scale = gl.load(WScale)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(free.index((j - 1) % NS), count=1)
        if SCALE_ROWS:
            acc = acc * scale[:, None]
        if SCALE_W:
            acc = acc * w_scale

        if EPILOGUE == PLAIN:
            tma.store_wait(0)  # the last tile's store has read the buffer
            out.store(acc.to(c_desc.dtype))
        elif EPILOGUE == RELU2:
            acc = gl.maximum(acc, 0.0)
            acc = acc * acc
            tma.store_wait(0)
            out.store(acc.to(c_desc.dtype))
        elif EPILOGUE == RELU2_GRAD:
            mbarrier.wait(g_ready.index(WG), i & 1)
            acc = acc * (2.0 * gl.sqrt(out.load(mma).to(gl.float32)))
            out.store(acc.to(c_desc.dtype))
        elif EPILOGUE == RESIDUAL:
            mbarrier.wait(g_ready.index(WG), i & 1)
            acc = acc + out.load(mma).to(gl.float32)  # one rounding of the sum, as addmm's
            out.store(acc.to(c_desc.dtype))
        else:
            tma.store_wait(0)
            out.store(acc.to(c_desc.dtype))
            heads, first = N // HEAD_DIM, 0
            if second:
                heads, first = N2 // HEAD_DIM, N // HEAD_DIM
            _rope_norm_epilogue(out, cos, sin, Rstd, r0, M, n0 // HEAD_DIM, heads, first,
                                (N + N2) // HEAD_DIM, HEAD_DIM, rows_layout)
        # Stored at once: deferring the store under the next tile's first product measured 3-5% slower (it
        # competes with the products for shared-memory bandwidth).
        fence_async_shared()
        if second:
            tma_store(c2_desc, [r0, n0], out)
        else:
            tma_store(c_desc, [r0, n0], out)
        i += 1
    tma.store_wait(0)


@gluon.jit
def _second_mma_partition(args, EPILOGUE: gl.constexpr, HEAD_DIM: gl.constexpr, SCALE_ROWS: gl.constexpr,
                          SCALE_W: gl.constexpr, B_KN: gl.constexpr):
    _mma_partition(args, 1, EPILOGUE, HEAD_DIM, SCALE_ROWS, SCALE_W, B_KN)


@gluon.jit
def _matmul_kernel(a_desc, a2_desc, b_desc, b2_desc, c_desc, c2_desc, g_desc, Cos, Sin, Rstd, RowScale,
                   WScale, M, N, N2, K, K1, EPILOGUE: gl.constexpr, HEAD_DIM: gl.constexpr,
                   SCALE_ROWS: gl.constexpr, SCALE_W: gl.constexpr, B_KN: gl.constexpr, STAGES: gl.constexpr):
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
    n_tiles_n1 = gl.cdiv(N, BN)
    n_tiles_n = n_tiles_n1 + gl.cdiv(N2, BN)
    n_tiles = gl.cdiv(M, BM) * n_tiles_n
    args = (a_desc, a2_desc, b_desc, b2_desc, c_desc, c2_desc, g_desc, a_smem, b_smem, c_smem, ready, free,
            g_ready, Cos, Sin, Rstd, RowScale, WScale, M, N, N2, K, K1, n_tiles, n_tiles_n1, n_tiles_n)
    gl.warp_specialize([
        (_mma_partition, (args, 0, EPILOGUE, HEAD_DIM, SCALE_ROWS, SCALE_W, B_KN)),
        (_second_mma_partition, (args, EPILOGUE, HEAD_DIM, SCALE_ROWS, SCALE_W, B_KN)),
        (_load_partition, (args, B_KN)),
    ], [4, 1], [240, 24])


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these [rows, cols] tensors suit the kernel: a Hopper GPU, 16-bit, row-major with 16-byte
    aligned rows."""
    x = tensors[0]
    if not x.is_cuda or capability(x.device)[0] != 9:
        return False
    return all(
        t.dtype == x.dtype in (torch.bfloat16, torch.float16)
        and t.dim() == 2
        and t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and t.stride(0) * 2 % 16 == 0
        for t in tensors
    )


def descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(x, block, nvmma_layout(tuple(block), x.dtype))


def _k_block(a: torch.Tensor, b: torch.Tensor, w_scale: torch.Tensor | None) -> int:
    """The columns of K per ring slot for A B^T: FP8 operands (both, with B's scale) or 16-bit ones."""
    fp8 = a.dtype in FP8
    if fp8 != (b.dtype in FP8) or fp8 != (w_scale is not None):
        raise ValueError(
            f"{a.dtype} and {b.dtype} operands with{'out' if w_scale is None else ''} a weight scale: FP8 "
            "products take FP8 operands and the weight's float32 scale, 16-bit ones neither"
        )
    if fp8 and (w_scale.numel() != 1 or w_scale.dtype != torch.float32):
        raise ValueError(f"w_scale {w_scale.dtype} {tuple(w_scale.shape)}: expected one float32")
    return BK_FP8 if fp8 else BK


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The output's dtype: bf16 for FP8 operands, else theirs."""
    return torch.bfloat16 if x.dtype in FP8 else x.dtype


def _check_rstd(rstd: torch.Tensor | None, M: int) -> None:
    if rstd is not None and (rstd.shape != (M,) or rstd.dtype != torch.float32 or not rstd.is_contiguous()):
        raise ValueError(f"rstd {rstd.dtype} {tuple(rstd.shape)}: expected contiguous float32 [{M}]")


def relu2_matmul(
    x: torch.Tensor, w1: torch.Tensor, rstd: torch.Tensor | None = None, w_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """a = relu(x w1^T)^2 for x [M, K] and w1 [N, K]; with rstd (float32 [M]), of x's rows scaled by it.
    FP8 x and w1 (a bf16 a) take w1's float32 scale, w_scale: a = relu(rstd * w_scale * x w1^T)^2, where
    rstd also carries x's row scales."""
    (M, K), N = x.shape, w1.shape[0]
    if w1.shape[1] != K:
        raise ValueError(f"x {tuple(x.shape)} and w1 {tuple(w1.shape)}: expected [M, K] and [N, K]")
    _check_rstd(rstd, M)
    bk = _k_block(x, w1, w_scale)
    a = torch.empty(M, N, device=x.device, dtype=_out_dtype(x))
    a_desc, w1_desc = descriptor(a, [BM // 2, BN]), descriptor(w1, [BN, bk])
    _launch(
        RELU2, descriptor(x, [BM, bk]), w1_desc, w1_desc, a_desc, a_desc, a_desc, M, N, 0, K,
        row_scale=rstd, w_scale=w_scale,
    )
    return a


def relu2_grad_matmul(
    g: torch.Tensor,
    w2_t: torch.Tensor,
    a: torch.Tensor,
    rstd: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """dh = (g w2) * 2 sqrt(a) for g [M, K], w2_t = w2^T [N, K] (row-major, as an nn.Linear weight) and the
    forward's a [M, N]; with rstd (float32 [M]), its rows scaled by it. FP8 g and w2_t (a and dh in bf16)
    take w2_t's float32 scale, w_scale, as relu2_matmul."""
    (M, K), N = g.shape, w2_t.shape[0]
    if w2_t.shape[1] != K or a.shape != (M, N):
        raise ValueError(
            f"g {tuple(g.shape)}, w2_t {tuple(w2_t.shape)}, a {tuple(a.shape)}: "
            "expected [M, K], [N, K], [M, N]"
        )
    _check_rstd(rstd, M)
    bk = _k_block(g, w2_t, w_scale)
    if a.dtype != _out_dtype(g):
        raise ValueError(f"a {a.dtype}: expected {_out_dtype(g)} for {g.dtype} operands")
    dh = torch.empty(M, N, device=g.device, dtype=a.dtype)
    w_desc, dh_desc = descriptor(w2_t, [BN, bk]), descriptor(dh, [BM // 2, BN])
    _launch(
        RELU2_GRAD, descriptor(g, [BM, bk]), w_desc, w_desc, dh_desc, dh_desc, descriptor(a, [BM // 2, BN]),
        M, N, 0, K, row_scale=rstd, w_scale=w_scale,
    )
    return dh


def residual_matmul(r: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """r + y w^T for r [M, N], y [M, K] and w [N, K]."""
    (M, K), N = y.shape, w.shape[0]
    if w.shape[1] != K or r.shape != (M, N):
        raise ValueError(
            f"r {tuple(r.shape)}, y {tuple(y.shape)}, w {tuple(w.shape)}: expected [M, N], [M, K], [N, K]"
        )
    out = y.new_empty(M, N)
    w_desc, out_desc = descriptor(w, [BN, BK]), descriptor(out, [BM // 2, BN])
    _launch(
        RESIDUAL, descriptor(y, [BM, BK]), w_desc, w_desc, out_desc, out_desc, descriptor(r, [BM // 2, BN]),
        M, N, 0, K,
    )
    return out


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    row_scale: torch.Tensor,
    w_scale: torch.Tensor,
    r: torch.Tensor | None = None,
) -> torch.Tensor:
    """row_scale * w_scale * a b^T in bf16 for FP8 a [M, K] and b [N, K] (both K-major, as FP8 products take
    them), row_scale float32 [M] and one float32 w_scale; with r [M, N] (bf16), r plus that (the residual
    epilogue, rounded once)."""
    (M, K), N = a.shape, b.shape[0]
    if b.shape[1] != K or (r is not None and r.shape != (M, N)):
        raise ValueError(
            f"a {tuple(a.shape)}, b {tuple(b.shape)}, r {None if r is None else tuple(r.shape)}: expected "
            "[M, K], [N, K], [M, N]"
        )
    _check_rstd(row_scale, M)
    bk = _k_block(a, b, w_scale)
    if a.dtype not in FP8 or (r is not None and r.dtype != torch.bfloat16):
        raise ValueError(f"a {a.dtype}, r {None if r is None else r.dtype}: expected FP8 and bfloat16")
    c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    b_desc, c_desc = descriptor(b, [BN, bk]), descriptor(c, [BM // 2, BN])
    r_desc = c_desc if r is None else descriptor(r, [BM // 2, BN])
    _launch(
        PLAIN if r is None else RESIDUAL, descriptor(a, [BM, bk]), b_desc, b_desc, c_desc, c_desc, r_desc,
        M, N, 0, K, row_scale=row_scale, w_scale=w_scale,
    )
    return c


def rope_norm_matmul(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    row_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys from one product: q = rms_norm(rope(x wq^T)) and k likewise with wk, per head of
    head_dim, for x [M, K], wq [Nq, K], wk [Nk, K] and each row's rotary angles cos, sin [M, head_dim / 2]
    (float32). Also returns each head's 1/rms, float32 [M, (Nq + Nk) / head_dim], queries' heads first.
    FP8 x, wq and wk (bf16 q and k) take x's row scales, row_scale (float32 [M]), and the weights' one
    float32 scale, w_scale: the product is row_scale * w_scale * x w^T before the rotation."""
    (M, K), Nq, Nk = x.shape, wq.shape[0], wk.shape[0]
    if wq.shape[1] != K or wk.shape[1] != K or Nq % head_dim or Nk % head_dim or BN % head_dim:
        raise ValueError(
            f"x {tuple(x.shape)}, wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, head_dim {head_dim}: expected "
            f"[M, K], [Nq, K], [Nk, K] with whole heads of a head_dim that divides {BN}"
        )
    if cos.shape != (M, head_dim // 2) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError(
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: expected float32 [{M}, {head_dim // 2}]"
        )
    if wk.dtype != wq.dtype or (row_scale is None) != (w_scale is None):
        raise ValueError(
            f"wq {wq.dtype}, wk {wk.dtype}, row_scale {row_scale is not None}, w_scale "
            f"{w_scale is not None}: expected one dtype for the weights, and both scales (FP8) or neither"
        )
    _check_rstd(row_scale, M)
    bk = _k_block(x, wq, w_scale)
    q = torch.empty(M, Nq, device=x.device, dtype=_out_dtype(x))
    k = torch.empty(M, Nk, device=x.device, dtype=_out_dtype(x))
    rstd = torch.empty(M, (Nq + Nk) // head_dim, device=x.device, dtype=torch.float32)
    q_desc, k_desc = descriptor(q, [BM // 2, BN]), descriptor(k, [BM // 2, BN])
    _launch(
        ROPE_NORM, descriptor(x, [BM, bk]), descriptor(wq, [BN, bk]), descriptor(wk, [BN, bk]), q_desc,
        k_desc, q_desc, M, Nq, Nk, K, cos.contiguous(), sin.contiguous(), rstd, head_dim,
        row_scale=row_scale, w_scale=w_scale,
    )
    return q, k, rstd


def matmul(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """a b for a [M, K] and b [K, N]; with r [M, N], r + a b (the residual epilogue)."""
    if a.dim() != 2 or b.dim() != 2 or b.shape[0] != a.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)}: expected [M, K] and [K, N]")
    if r is not None and r.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"r {tuple(r.shape)}: expected [{a.shape[0]}, {b.shape[1]}] for a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    return _kn_product(a, None, b, r)


def joined_matmul(a1: torch.Tensor, a2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a1 | a2] b for a1 [M, K1], a2 [M, K2] and b [K1 + K2, N] (K1 a multiple of BK), without joining a1
    and a2 in memory: the input gradient of stacked nn.Linear weights b from their outputs' gradients."""
    (M, K1), K2 = a1.shape, a2.shape[1]
    if a2.shape[0] != M or b.shape[0] != K1 + K2 or K1 % BK:
        raise ValueError(
            f"a1 {tuple(a1.shape)}, a2 {tuple(a2.shape)}, b {tuple(b.shape)}: expected [M, K1], [M, K2], "
            f"[K1 + K2, N] with K1 a multiple of {BK}"
        )
    return _kn_product(a1, a2, b, None)


def _kn_product(
    a1: torch.Tensor, a2: torch.Tensor | None, b: torch.Tensor, r: torch.Tensor | None
) -> torch.Tensor:
    """[a1 | a2] b (a1 b without a2), plus r where given; shapes checked by the caller."""
    M, K, N = a1.shape[0], b.shape[0], b.shape[1]
    c = a1.new_empty(M, N)
    b_desc, c_desc = descriptor(b, [BK, BN]), descriptor(c, [BM // 2, BN])
    r_desc = c_desc if r is None else descriptor(r, [BM // 2, BN])
    _launch(
        PLAIN if r is None else RESIDUAL, descriptor(a1, [BM, BK]), b_desc, b_desc, c_desc, c_desc, r_desc,
        M, N, 0, K, a2_desc=None if a2 is None else descriptor(a2, [BM, BK]), K1=a1.shape[1], b_kn=True,
    )
    return c


def _launch(epilogue: gl.constexpr, a_desc, b_desc, b2_desc, c_desc, c2_desc, g_desc, M: int, N: int, N2: int,
            K: int, cos=None, sin=None, rstd=None, head_dim: int = 0, a2_desc=None, K1: int | None = None,
            b_kn: bool = False, row_scale=None, w_scale=None) -> None:
    """C = epilogue(A B^T) over the columns of B (N) and then of B2 (N2) if any, into C and C2. A's first K1
    columns come from a_desc and the rest from a2_desc, where given (K1 a multiple of BK). B is [N, K], or
    with b_kn [K, N] (B^T's layout; no B2 then). rstd: each head's 1/rms, written by the q/k product.
    row_scale: A's rows' scales (float32 [M]: the MLP's 1/rms, FP8 row scales), multiplied into the
    product before the epilogue, where given. w_scale: B's FP8 scale (one float32), where given."""
    n_tiles = triton.cdiv(M, BM) * (triton.cdiv(N, BN) + triton.cdiv(N2, BN))
    programs = min(n_tiles, sm_count(a_desc.base.device))
    _matmul_kernel[(programs,)](
        a_desc, a_desc if a2_desc is None else a2_desc, b_desc, b2_desc, c_desc, c2_desc, g_desc, cos, sin,
        rstd, row_scale, w_scale, M, N, N2, K, K if K1 is None else K1,
        EPILOGUE=epilogue.value, HEAD_DIM=head_dim, SCALE_ROWS=row_scale is not None,
        SCALE_W=w_scale is not None, B_KN=b_kn, STAGES=STAGES, num_warps=WARPS, maxnreg=MAX_REGISTERS,
    )
