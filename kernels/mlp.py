"""`relu2_mlp`: the ReLU^2 MLP, out = relu(x W1^T)^2 W2^T, as PyTorch custom operators with autograd.

On Hopper the products that feed and follow the activation run kernels/gemm_hopper.py, which does the
elementwise work in their epilogues: the forward writes a = relu(x W1^T)^2 straight from the product (never
h = x W1^T), and the backward writes dh = (g W2) * 2 sqrt(a) straight from its product, with sqrt(a) =
relu(h) standing in for the h that was never kept. The weight gradients run kernels/wgrad_hopper.py where
that beats cuBLAS (its `preferred`: d20's widths at full batch); the other products are cuBLAS's.
Elsewhere the operators run the same formulas in PyTorch (`reference_*`).
The operators take W2 transposed ([H, C], row-major), so that both fused products read their weight in
nn.Linear's layout; `relu2_mlp` makes that copy (cast and transpose in one compiled kernel when traced).
End to end that measured the same as a kernel that reads W2 as it is.
Both operators have fake implementations, so torch.compile traces through them without a graph break.
"""

import torch


def _fused(*tensors: torch.Tensor) -> bool:
    if not tensors[0].is_cuda:
        return False
    from kernels import gemm_hopper

    return gemm_hopper.supported(*tensors)


def _weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g^T x, summed over the tokens."""
    if g.is_cuda:
        from kernels import wgrad_hopper

        if wgrad_hopper.preferred(g, x):
            return wgrad_hopper.weight_grad(g, x)
    return g.t() @ x


def reference_forward(x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """a = relu(x w1^T)^2."""
    return torch.relu(x @ w1.t()).square()


def reference_grad(g: torch.Tensor, w2_t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """dh = (g w2) * 2 sqrt(a), with w2_t = w2^T: d relu(h)^2 / dh = 2 relu(h), and relu(h) = sqrt(a)."""
    return (g @ w2_t.t()) * (2 * a.sqrt())


@torch.library.custom_op("varlen_gpt::relu2_mlp_fwd", mutates_args=())
def relu2_mlp_fwd(x: torch.Tensor, w1: torch.Tensor, w2_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _fused(x, w1):
        from kernels.gemm_hopper import relu2_matmul

        a = relu2_matmul(x, w1)
    else:
        a = reference_forward(x, w1)
    return a @ w2_t, a


@relu2_mlp_fwd.register_fake
def _(x, w1, w2_t):
    return x.new_empty(x.shape[0], w2_t.shape[1]), x.new_empty(x.shape[0], w1.shape[0])


@torch.library.custom_op("varlen_gpt::relu2_mlp_bwd", mutates_args=())
def relu2_mlp_bwd(
    g: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2_t: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = g.contiguous()
    if _fused(g, w2_t, a):
        from kernels.gemm_hopper import relu2_grad_matmul

        dh = relu2_grad_matmul(g, w2_t, a)
    else:
        dh = reference_grad(g, w2_t, a)
    # W2's gradient in W2's layout, seen as W2^T's: the fp32 gradient that autograd adds up over the
    # micro-batches then has W2's layout too, which takes a vectorised add instead of a strided one.
    return dh @ w1, _weight_grad(dh, x), _weight_grad(g, a).t()


@relu2_mlp_bwd.register_fake
def _(g, x, w1, w2_t, a):
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2_t.new_empty(w2_t.shape[1], w2_t.shape[0]).t()


def _setup_context(ctx, inputs, output):
    x, w1, w2_t = inputs
    ctx.save_for_backward(x, w1, w2_t, output[1])


def _backward(ctx, grad_out, grad_a):
    # a is an output only so that the backward can keep it; nothing downstream differentiates it.
    x, w1, w2_t, a = ctx.saved_tensors
    return relu2_mlp_bwd(grad_out, x, w1, w2_t, a)


relu2_mlp_fwd.register_autograd(_backward, setup_context=_setup_context)


def relu2_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """relu(x w1^T)^2 w2^T for x [T, C], w1 [H, C] and w2 [C, H], in x's dtype (the weights are cast to it,
    as autocast would cast them for the products)."""
    if x.dim() != 2 or w1.shape != (w2.shape[1], x.shape[1]) or w2.shape[0] != x.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}: expected [T, C], [H, C], [C, H]"
        )
    out, _ = relu2_mlp_fwd(x.contiguous(), w1.to(x.dtype), w2.t().to(x.dtype).contiguous())
    return out
