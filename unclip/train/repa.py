"""Representation alignment (REPA; Yu et al. 2024) for the base decoder.

A small projection head maps the features of one UNet block, computed on the noisy input ``x_t``,
onto the frozen CLIP image tower's features of the clean training image at one of its layers; the
decoder's loss adds ``repa.weight · (1 − cosine)``, averaged over the feature map's positions. The
decoder is pulled towards features the CLIP already separates (shape, position) instead of having
to find them from pixels alone. The head trains with the decoder, is saved in checkpoints, and is
left out of the exported decoder: sampling never runs it.

The stage config's ``repa:`` section (:class:`~unclip.train.config.RepaConfig`) turns it on:
``decoder_layer`` names a UNet submodule (``mid_block``, ``down_blocks.2``, ...) and
``clip_layer`` a module of the CLIP's image tower: a convolutional stage of open_clip's
ModifiedResNet (``layer1``..``layer4``, a ``[B, C, H, W]`` map) or a ViT block
(``transformer.resblocks.<i>``, whose patch tokens are laid out on the patch grid). The decoder's
feature map is average-pooled to the CLIP map's size when it is larger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from unclip.clip import CLIP

__all__ = ["RepaDecoder", "alignment_loss", "clip_features", "exported_model"]


def _block_output(output):
    # diffusers' down blocks return (hidden_states, residuals)
    return output[0] if isinstance(output, tuple) else output


def _named(root: nn.Module, name: str, key: str) -> nn.Module:
    modules = dict(root.named_modules())
    if name not in modules or not name:
        top = [n for n, _ in root.named_children()]
        raise ValueError(f"{key}={name!r} names no module; the top-level ones are {top}")
    return modules[name]


@torch.no_grad()
def clip_features(clip: CLIP, images: torch.Tensor, layer: str) -> torch.Tensor:
    """The CLIP image tower's output at ``layer`` for ``images [B, 3, H, W]`` in [-1, 1], as a
    ``[B, C, h, w]`` float feature map (the tower runs up to that layer only)."""
    module = _named(clip.model.visual, layer, "repa.clip_layer")
    captured = []

    class _Enough(Exception):
        pass

    def grab(_module, _args, output):
        captured.append(output)
        raise _Enough

    handle = module.register_forward_hook(grab)
    try:
        clip.model.visual(clip.preprocess_tensor(images.to(clip.device)).to(clip.dtype))
    except _Enough:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError(f"repa.clip_layer={layer!r} did not run in the CLIP's image tower")
    out = _feature_map(clip.model.visual, captured[0])
    if out is None:
        got = captured[0]
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(
            f"repa.clip_layer={layer!r} outputs {shape}, not a feature map; name a convolutional "
            "stage of a ModifiedResNet (layer1..layer4) or a block of a ViT "
            "(transformer.resblocks.<i>)"
        )
    return out.float()


def _feature_map(visual: nn.Module, out) -> torch.Tensor | None:
    """``out`` as ``[B, C, h, w]``: a convolutional map as it is; a ViT block's tokens without
    the class (and register) tokens in front, laid out on the patch grid."""
    if not isinstance(out, torch.Tensor):
        return None
    if out.ndim == 4:
        return out
    grid = getattr(visual, "grid_size", None)
    if out.ndim != 3 or grid is None:
        return None
    if not getattr(getattr(visual, "transformer", None), "batch_first", True):
        out = out.transpose(0, 1)  # [L, B, D] → [B, L, D]
    gh, gw = grid
    if out.shape[1] < gh * gw:
        return None
    patches = out[:, out.shape[1] - gh * gw :]
    return patches.transpose(1, 2).reshape(out.shape[0], out.shape[2], gh, gw)


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``1 − cosine`` between the projected decoder features and the CLIP features over channels,
    averaged over positions: per sample ``[B]``. ``projected`` is average-pooled to ``target``'s
    size when larger; a smaller one is an error."""
    h, w = target.shape[-2:]
    if projected.shape[-2] < h or projected.shape[-1] < w:
        raise ValueError(
            f"the decoder's repa.decoder_layer features are {tuple(projected.shape[-2:])}, "
            f"smaller than the CLIP layer's {(h, w)}; align a higher-resolution UNet block or a "
            "deeper CLIP layer"
        )
    if projected.shape[-2:] != (h, w):
        projected = F.adaptive_avg_pool2d(projected, (h, w))
    cos = F.cosine_similarity(projected.float(), target.float(), dim=1)
    return (1 - cos).flatten(1).mean(1)


class RepaDecoder(nn.Module):
    """The decoder being trained plus its alignment head. ``forward`` takes the decoder's
    arguments and returns ``(prediction, projected features)``; ``save_pretrained`` writes the
    decoder alone."""

    def __init__(self, decoder: nn.Module, decoder_layer: str, clip_channels: int, hidden: int):
        super().__init__()
        self.decoder = decoder
        self.decoder_layer = decoder_layer
        block = _named(decoder.unet, decoder_layer, "repa.decoder_layer")
        channels = _output_channels(block, decoder_layer)
        self.head = nn.Sequential(
            nn.Conv2d(channels, hidden, 1),
            nn.SiLU(),
            nn.Conv2d(hidden, hidden, 1),
            nn.SiLU(),
            nn.Conv2d(hidden, clip_channels, 1),
        )

    def forward(self, *args, **kwargs):
        captured = []
        block = self.decoder.unet.get_submodule(self.decoder_layer)
        handle = block.register_forward_hook(
            lambda _m, _a, out: captured.append(_block_output(out))
        )
        try:
            pred = self.decoder(*args, **kwargs)
        finally:
            handle.remove()
        if not captured:
            raise RuntimeError(f"repa.decoder_layer={self.decoder_layer!r} did not run")
        return pred, self.head(captured[-1].to(self.head[0].weight.dtype))

    def save_pretrained(self, *args, **kwargs):
        return self.decoder.save_pretrained(*args, **kwargs)


def _output_channels(block: nn.Module, name: str) -> int:
    """The channel count of a diffusers UNet block's (or resnet's) output."""
    channels = getattr(block, "out_channels", None)
    resnets = getattr(block, "resnets", None)
    if channels is None and resnets:
        channels = resnets[-1].out_channels
    if not isinstance(channels, int):
        raise ValueError(
            f"repa.decoder_layer={name!r} is not a UNet block with a known output width; name "
            "one of mid_block, down_blocks.<i>, up_blocks.<i> or a resnet in them"
        )
    return channels


def exported_model(model: nn.Module) -> nn.Module:
    """The network a training run exports and loads initial weights into: the decoder inside a
    :class:`RepaDecoder`, else ``model`` itself."""
    return model.decoder if isinstance(model, RepaDecoder) else model
