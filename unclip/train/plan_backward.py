"""The dry run's backward, attention kernels and checkpoint write on fake CUDA tensors.

**Backward.** The autograd engine cannot run on a fake CUDA device without a driver: before it
runs a node it stashes the current stream of every CUDA device, and asking the driver which
devices have a context fails (pytorch/pytorch#92627). :func:`fake_backward` is the engine's
scheduling written in Python over the same graph: every node's own backward formula runs (the C++
derivative of each op, a custom ``autograd.Function``'s ``backward``, the flash-attention
backward, activation checkpointing's recompute through its saved-tensor hooks), in the engine's
order (the highest sequence number among the ready nodes first, a node once all its gradients
have arrived), each gradient freed once consumed and each node released once run, so the memory
tracker sees backward's real allocations. What it leaves out: hooks registered on tensors or
nodes (none run in a one-process step: DDP's and FSDP's reducers are not there) and streams.

**Attention.** On a fake CUDA tensor ``scaled_dot_product_attention`` cannot ask the device which
fused kernels it supports and falls back to the math path, which saves the whole attention matrix
for backward. :func:`gpu_attention` routes it to the kernel an A100 takes for half-precision
inputs: flash attention without a mask, memory-efficient attention with one (both save only
their output and log-sum-exp); fp32 inputs keep the math path, as on a GPU without TF32 kernels.

**Checkpoint.** :func:`checkpoint_sink` lets the training loop's own checkpoint code run, with
the safetensors writers replaced by a sink that counts each file's tensor bytes and writes none.

Two checks of the step live here too: which autocast weight copies backward keeps
(:func:`autocast_copies`) and that all training state is on the device (:func:`check_devices`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "fake_backward",
    "tensor_inputs_recorded",
    "gpu_attention",
    "checkpoint_sink",
    "autocast_copies",
    "check_devices",
]

_TENSOR_INPUTS = "_plan_tensor_inputs"


@contextlib.contextmanager
def tensor_inputs_recorded() -> Iterator[None]:
    """Record, on each custom ``autograd.Function`` node made inside, which of its forward's
    arguments were tensors: its ``backward`` returns one gradient per argument, its graph edges
    are the tensor arguments only, and the engine keeps that map in C++ where Python cannot read
    it."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        out = original.__get__(None, cls)(*args, **kwargs)
        mask = tuple(isinstance(a, torch.Tensor) for a in args)
        for t in tree_leaves(out):
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None and hasattr(fn, "_forward_cls"):
                setattr(fn, _TENSOR_INPUTS, mask)
        return out

    with mock.patch.object(torch.autograd.Function, "apply", classmethod(apply)):
        yield


def _run_node(fn, grads: list):
    """One node's backward: its gradients per graph edge."""
    if hasattr(fn, "_forward_cls"):  # a Python autograd.Function
        if getattr(fn, "materialize_grads", True) and any(g is None for g in grads):
            raise RuntimeError(
                f"{type(fn).__name__}: an output without a gradient cannot be materialised in "
                "the dry run's backward"
            )
        outs = fn.apply(*grads)
        outs = outs if isinstance(outs, tuple) else (outs,)
        mask = getattr(fn, _TENSOR_INPUTS, None)
        if mask is not None and len(mask) == len(outs):
            outs = tuple(g for g, is_tensor in zip(outs, mask) if is_tensor)
        if len(outs) != len(fn.next_functions):
            raise RuntimeError(
                f"{type(fn).__name__} returned {len(outs)} gradients for "
                f"{len(fn.next_functions)} inputs"
            )
        return outs
    outs = fn(*grads)
    return outs if isinstance(outs, tuple) else (outs,)


def _validated(g: torch.Tensor, meta, fn, slot: int) -> torch.Tensor:
    """What the engine does with a gradient before passing it on: reduce a broadcast gradient to
    the input's shape, cast it to the input's dtype, and refuse another device."""
    if g.device != meta.device and g.dim() != 0:
        raise RuntimeError(
            f"invalid gradient for {fn.name()} input {slot}: expected device {meta.device} but "
            f"got {g.device}"
        )
    if tuple(g.shape) != tuple(meta.shape):
        g = g.sum_to_size(meta.shape)
    if g.dtype != meta.dtype:
        g = g.to(meta.dtype)
    return g


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """What ``AccumulateGrad`` does: the first gradient is kept (in the parameter's layout),
    later ones are added in place."""
    if grad is None:
        return
    if leaf.grad is None:
        if grad.dtype != leaf.dtype or grad.stride() != leaf.stride():
            # a fresh tensor in the parameter's layout (a view of the gradient's own storage
            # would copy onto itself)
            like = torch.empty_strided(
                leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device
            )
            grad = like.copy_(grad)
        leaf.grad = grad.detach()
    else:
        leaf.grad.add_(grad)


def _dependencies(root) -> dict:
    deps: dict = {}
    seen, stack = {root}, [root]
    while stack:
        fn = stack.pop()
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return deps


def fake_backward(loss) -> None:
    """``loss.backward()`` without the engine: see the module doc. ``loss`` is a scalar, or a
    one-element list holding it, which is emptied: the graph is then released node by node as
    backward runs, as the engine does, provided no one else holds the loss or its intermediate
    tensors."""
    if isinstance(loss, list):
        loss = loss.pop()
    if loss.grad_fn is None:
        raise RuntimeError("the loss does not require grad: nothing in the model is trained")
    root = loss.grad_fn
    deps = _dependencies(root)
    buffers: dict[Any, list[Optional[torch.Tensor]]] = {root: [torch.ones_like(loss)]}
    order = itertools.count()  # ties among equal sequence numbers: first come, first run
    ready = [(-root._sequence_nr(), next(order), root)]
    del loss, root  # from here on the queue holds the graph: each node dies once run
    from torch.utils.checkpoint import GraphExecGroup

    # one recompute per checkpointed block, as under one engine call
    with torch.no_grad(), GraphExecGroup():
        while ready:
            _, _, fn = heapq.heappop(ready)
            grads = buffers.pop(fn)
            leaf = getattr(fn, "variable", None)
            if leaf is not None:  # AccumulateGrad
                if grads[0] is not None:
                    _accumulate(leaf, grads[0])
                continue
            outs = _run_node(fn, grads)
            del grads
            for (nxt, slot), g in zip(fn.next_functions, outs):
                if nxt is None:
                    continue
                buf = buffers.get(nxt)
                if buf is None:
                    buf = buffers[nxt] = [None] * len(nxt._input_metadata)
                if g is not None:
                    g = _validated(g, nxt._input_metadata[slot], nxt, slot)
                    buf[slot] = g if buf[slot] is None else buf[slot] + g
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    del deps[nxt]  # from here on only the queue holds it
                    heapq.heappush(ready, (-nxt._sequence_nr(), next(order), nxt))
            del outs, fn  # the node's saved tensors go with its last reference


_sdpa = F.scaled_dot_product_attention


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    half = q.dtype in (torch.float16, torch.bfloat16)
    if not half or q.device.type != "cuda" or kw or q.shape[-1] > 256 or q.dim() != 4:
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kw)
    if attn_mask is None:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if attn_mask.dtype == torch.bool:  # the efficient kernel takes an additive bias
        bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        attn_mask = bias.masked_fill(~attn_mask, float("-inf"))
    attn_mask = attn_mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
    )
    return out[0]


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` takes a GPU's fused kernels on fake CUDA tensors (see
    the module doc)."""
    with mock.patch.object(F, "scaled_dot_product_attention", _fused_attention):
        yield


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def checkpoint_sink() -> Iterator[dict]:
    """The checkpoint's safetensors files counted, not written: yields ``{file name: bytes of
    tensor data}`` (the header of each file, a few KiB of JSON, is not counted)."""
    import safetensors.torch as st

    from unclip.train import checkpoint as ckpt

    sizes: dict[str, int] = {}

    def save_file(tensors, path, metadata=None):
        sizes[Path(path).name] = _nbytes(tensors.values())

    def save_model(model, path, metadata=None, force_contiguous=False):
        save_file(model.state_dict(), path)

    def save_tensors(tensors, path, *args, **kwargs):
        save_file(tensors, path)

    with (
        mock.patch.object(st, "save_file", save_file),
        mock.patch.object(st, "save_model", save_model),
        mock.patch.object(ckpt, "save_tensors", save_tensors),
    ):
        yield sizes


@contextlib.contextmanager
def autocast_copies(params):
    """Weak references to the half-precision copies autocast makes of ``params``: those still
    alive after the forward are kept for backward."""
    ids = {id(p) for p in params}
    found: list[weakref.ref] = []

    class _Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args and id(args[0]) in ids:
                found.append(weakref.ref(out))  # weak: only those backward keeps count
            return out

    with _Casts():
        yield found


def check_devices(loop, model, device) -> None:
    """Every piece of training state must live on the training device: a stray CPU tensor is a
    cross-device copy per step on a GPU, or a crash."""
    want = torch.device(device).type

    def bad(tensors, what):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != want:
                raise RuntimeError(
                    f"{what} is on {t.device}, the model trains on {device}: every piece of "
                    "training state must live on the training device"
                )

    bad(model.parameters(), "a parameter")
    if loop.ema is not None:
        bad(loop.ema.shadow_params, "an EMA weight")
    for state in loop.optimizer.state.values():
        bad(state.values(), "optimizer state")
