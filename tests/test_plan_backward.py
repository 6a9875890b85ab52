"""The dry run's backward without the autograd engine, its attention kernels and checkpoint sink:
the same gradients as ``loss.backward()`` on real CPU tensors, and the fused kernels' backward on
fake CUDA tensors."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from unclip.train.plan_backward import fake_backward, gpu_attention, tensor_inputs_recorded

pytestmark = pytest.mark.usefixtures("one_thread")


class _Cube(torch.autograd.Function):
    """A custom function whose arguments mix tensors and a number."""

    @staticmethod
    def forward(ctx, scale, x):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return None, 3 * ctx.scale * x**2 * grad


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 8)
        self.bias = torch.nn.Parameter(torch.randn(8))  # broadcast over the batch
        self.c = torch.nn.Linear(8, 2)

    def block(self, h):
        q = self.b(h).view(h.shape[0], 1, 2, 4)  # (batch, heads, tokens, dim)
        return F.scaled_dot_product_attention(q, q, q).reshape(h.shape) + torch.tanh(h)

    def forward(self, x):
        h = self.a(x)
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        h = _Cube.apply(0.5, h + self.bias)
        return self.c(h).pow(2).mean() + h.sum() * 1e-3


def test_fake_backward_gives_the_engines_gradients_on_cpu():
    """Checkpoint recompute, a custom Function with a non-tensor argument, a broadcast
    parameter, attention, and two accumulated backwards: equal to ``loss.backward()``."""
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(5, 6)
    for _ in range(2):
        net(x).backward()
    want = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    with tensor_inputs_recorded():
        for _ in range(2):
            fake_backward(net(x))
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_fused_attention_and_its_backward_run_on_fake_cuda():
    with FakeTensorMode(), gpu_attention():
        q = torch.randn(2, 4, 16, 64, device="cuda", dtype=torch.float16, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q)
        assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionBackward0"
        mask = torch.ones(16, 16, dtype=torch.bool, device="cuda").tril()
        masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        assert "EfficientAttention" in type(masked.grad_fn).__name__
        fake_backward(out.float().sum() + masked.float().sum())
        assert q.grad.shape == q.shape and q.grad.device.type == "cuda"
        # fp32 keeps the math path, as on a GPU
        x = torch.randn(2, 4, 16, 64, device="cuda", requires_grad=True)
        assert "Flash" not in type(F.scaled_dot_product_attention(x, x, x).grad_fn).__name__


def test_a_copy_to_the_cpu_sends_its_gradient_back_to_the_gpu():
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.randn(3, device="cuda"))
        loss = (w.cpu() * 2).sum()  # a copy to the CPU: its backward copies back
        fake_backward(loss)
        assert w.grad.device.type == "cuda"


def test_a_gradient_in_another_layout_is_stored_in_the_parameters():
    """A channels-last weight whose gradient arrives contiguous: stored in the weight's layout, as
    ``AccumulateGrad`` does, on real tensors too."""
    w = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    x = torch.randn(4, 3, 2, 2)
    fake_backward((w.contiguous() * x).sum())
    assert w.grad.stride() == w.stride()
    torch.testing.assert_close(w.grad, x)
