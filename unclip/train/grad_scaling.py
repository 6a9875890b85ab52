"""DALL-E's per-resblock gradient scaling (Ramesh et al. 2021, §2.4, Figure 4 and appendix D).

In 16-bit training the activation gradients shrink from block to block, and in a deep, wide network
the later blocks' fall below fp16's smallest exponent and round to zero, while one loss scale
large enough for them overflows the others. DALL-E gives each residual block its own gradient
scale: the gradient entering the block is multiplied by the block's scale, the gradient leaving it
(towards the earlier blocks) is divided by it again and *filtered* (non-finite values set to zero,
so one block's overflow does not spread to the blocks before it), and each scale adapts to its own
block's overflows.

:class:`ResblockGradScaler` does this for the residual blocks (diffusers' ``ResnetBlock2D``) of the
decoder's and upsamplers' UNets, with hooks and no change to the networks:

* a forward hook on each block registers a gradient hook on its output: ``grad * scale_i`` (in
  fp32, cast back to the gradient's dtype), so everything computed inside the block in backward —
  its activation gradients and its parameters' gradients — is ``scale_i`` times larger;
* a forward pre-hook gives the block a view of each input that needs a gradient (the feature map
  and the time embedding); the view's gradient hook divides by ``scale_i`` and filters, so the
  gradient that leaves the block is as without scaling;
* :meth:`unscale_` (once per optimizer step, after the last micro-batch's backward, before
  clipping) divides each block's parameter gradients by its scale, so the update is unchanged in
  exact arithmetic. A block whose filtered gradient or parameter gradients were non-finite has
  overflowed: its parameter gradients are made non-finite, so the loop skips the step as for any
  non-finite gradient (fp16's loss scaler backs off too);
* :meth:`update` then halves the scale of each block that overflowed and multiplies every other
  one by ``2 ** (1 / 1000)`` (DALL-E's growth rate: ×2 per 1000 steps), within
  [:data:`MIN_SCALE`, :data:`MAX_SCALE`].

Differences from the paper: the scales are relative to the loss scale of Accelerate's fp16
``GradScaler``, which still runs (DALL-E had no global scale and started each block at
``2**13 · replicas``); a block's scale starts at 1, so training starts as without the option;
an overflow halves the scale (DALL-E divided by √2 and allowed one division per 125 updates: with
a skipped step per overflow, such a window would stop this loop's run after
``train.max_consecutive_nonfinite`` skips); the gradient between blocks stays in the autocast dtype
(DALL-E kept the residual stream's gradients in fp32), so the scaling helps inside the blocks —
the convolutions' activation and weight gradients — not on the skip path.

The scales are part of the training state: checkpoints save them and a resume restores them.
Processes agree on the overflows (``reduce``), so every DDP process divides by the same scales.
Sharded strategies (FSDP, DeepSpeed) are refused: their gradients are not whole tensors here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

__all__ = ["ResblockGradScaler", "GROWTH", "BACKOFF", "MIN_SCALE", "MAX_SCALE", "resblocks"]

#: per-step growth of a block's scale without overflow (DALL-E: 2^(1/1000))
GROWTH = 2.0 ** (1 / 1000)
#: factor applied to a block's scale when it overflowed
BACKOFF = 0.5
#: bounds of a block's scale, relative to the loss scale (DALL-E kept 2^17 between its bounds)
MIN_SCALE = 2.0**-16
MAX_SCALE = 2.0**16


def resblocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The residual blocks of ``model``'s UNets (diffusers' ``ResnetBlock2D``), in module order."""
    from diffusers.models.resnet import ResnetBlock2D

    return [m for m in model.modules() if isinstance(m, ResnetBlock2D)]


class ResblockGradScaler:
    """Per-resblock gradient scales for ``model`` (see the module doc). ``init_scale``: every
    block's starting scale. ``scales`` is a float32 tensor ``[num_blocks]`` on the model's device;
    set it (e.g. ``scaler.scales.fill_(2.0)``) to start elsewhere."""

    def __init__(self, model: torch.nn.Module, init_scale: float = 1.0):
        self.blocks = resblocks(model)
        if not self.blocks:
            raise ValueError(
                "train.resblock_grad_scaling: the model has no residual blocks (diffusers "
                "ResnetBlock2D) to scale; it applies to the decoder and upsamplers"
            )
        device = next(model.parameters()).device
        n = len(self.blocks)
        self.scales = torch.full((n,), float(init_scale), dtype=torch.float32, device=device)
        # set by the gradient hooks (a non-finite gradient leaving block i) and by unscale_
        self.overflow = torch.zeros(n, dtype=torch.bool, device=device)
        self._params = [[p for p in b.parameters() if p.requires_grad] for b in self.blocks]
        self._handles = []
        for i, block in enumerate(self.blocks):
            self._handles.append(
                block.register_forward_pre_hook(self._input_hook(i), with_kwargs=True)
            )
            self._handles.append(block.register_forward_hook(self._output_hook(i)))

    # ------------------------------------------------------------------ hooks
    def _output_hook(self, i: int):
        def scale_up(grad: torch.Tensor) -> torch.Tensor:
            return (grad.float() * self.scales[i]).to(grad.dtype)

        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(scale_up)
            return output

        return hook

    def _input_hook(self, i: int):
        def scale_down(grad: torch.Tensor) -> torch.Tensor:
            out = (grad.float() / self.scales[i]).to(grad.dtype)
            finite = torch.isfinite(out)
            self.overflow[i] |= ~finite.all()
            return torch.where(finite, out, torch.zeros((), dtype=out.dtype, device=out.device))

        def wrap(x):
            if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
                # a view of its own: the hook then sees only the gradient that flows back through
                # this block, not the one the same tensor gets from its other uses (UNet skips)
                x = x.view_as(x)
                x.register_hook(scale_down)
            return x

        def hook(module, args, kwargs):
            return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

        return hook

    # ------------------------------------------------------------------ per optimizer step
    @torch.no_grad()
    def unscale_(self, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Divide each block's parameter gradients by its scale; mark the blocks whose gradients
        are non-finite as overflowed and make their gradients non-finite (the step is then
        skipped). ``reduce``: sums a tensor over the processes (DDP), so all agree."""
        for i, params in enumerate(self._params):
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            torch._foreach_div_(grads, self.scales[i])
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            self.overflow[i] |= ~finite
        if reduce is not None:
            self.overflow.copy_(reduce(self.overflow.float()) > 0)
        inf = torch.tensor(float("inf"), device=self.overflow.device)
        for i, params in enumerate(self._params):
            grads = [p.grad for p in params if p.grad is not None]
            if grads:  # inf where the block overflowed, + 0 elsewhere (no host sync)
                grads[0].add_(torch.where(self.overflow[i], inf, 0.0).to(grads[0].dtype))

    @torch.no_grad()
    def update(self) -> None:
        """Halve the scale of each block that overflowed since the last update, grow the others;
        clear the overflow marks."""
        grown = torch.where(self.overflow, self.scales * BACKOFF, self.scales * GROWTH)
        self.scales.copy_(grown.clamp(MIN_SCALE, MAX_SCALE))
        self.overflow.zero_()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The scales as JSON (float32 values are exact as Python floats)."""
        return {"scales": self.scales.cpu().tolist()}

    def load_state_dict(self, state: dict) -> None:
        scales = state["scales"]
        if len(scales) != len(self.blocks):
            raise ValueError(
                f"resblock gradient scales for {len(scales)} blocks, this model has "
                f"{len(self.blocks)}"
            )
        self.scales.copy_(torch.tensor(scales, dtype=torch.float32))
        self.overflow.zero_()

    def remove(self) -> None:
        """Remove the hooks (the model computes as without the scaler)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
