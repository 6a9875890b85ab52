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

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from unclip.nets.clip import CLIP
from unclip.nets.clip_features import named_submodule
from unclip.nets.decoder import UnCLIPDecoder

__all__ = [
    "RepaDecoder",
    "alignment_loss",
    "block_output_shape",
    "check_sizes",
    "clip_features",
    "exported_model",
    "exported_state",
]


def _block_output(output):
    # diffusers' down blocks return (hidden_states, residuals)
    return output[0] if isinstance(output, tuple) else output


def clip_features(clip: CLIP, images: torch.Tensor, layer: str) -> torch.Tensor:
    """The target features: :meth:`CLIP.layer_features <unclip.nets.clip.CLIP.layer_features>` of
    the clean images at ``repa.clip_layer`` (a CLIP method, so ``unclip plan`` counts the pass
    as the frozen CLIP's forward)."""
    return clip.layer_features(images, layer, key="repa.clip_layer")


def check_sizes(decoder_hw: tuple, clip_hw: tuple) -> None:
    """The decoder block's map must be at least the CLIP layer's size (it is pooled down to it)."""
    if decoder_hw[0] < clip_hw[0] or decoder_hw[1] < clip_hw[1]:
        raise ValueError(
            f"the decoder's repa.decoder_layer features are {tuple(decoder_hw)}, smaller than the "
            f"CLIP layer's {tuple(clip_hw)}; align a higher-resolution UNet block or a deeper "
            "CLIP layer"
        )


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``1 − cosine`` between the projected decoder features and the CLIP features over channels,
    averaged over positions: per sample ``[B]``. ``projected`` is average-pooled to ``target``'s
    size when larger; a smaller one is an error."""
    h, w = target.shape[-2:]
    check_sizes(tuple(projected.shape[-2:]), (h, w))
    if projected.shape[-2:] != (h, w):
        projected = F.adaptive_avg_pool2d(projected, (h, w))
    cos = F.cosine_similarity(projected.float(), target.float(), dim=1)
    return (1 - cos).flatten(1).mean(1)


class RepaDecoder(nn.Module):
    """The decoder being trained plus its alignment head. ``forward`` takes the decoder's
    arguments and returns ``(prediction, projected features)``; ``save_pretrained`` writes the
    decoder alone."""

    def __init__(
        self,
        decoder: UnCLIPDecoder,
        decoder_layer: str,
        channels: int,
        clip_channels: int,
        hidden: int,
    ):
        super().__init__()
        self.decoder = decoder
        self.decoder_layer = decoder_layer
        named_submodule(decoder.unet, decoder_layer, "repa.decoder_layer")
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
        # the block may run in half precision under a model-wide cast; the head's weights set
        # the dtype (autocast, when on, casts again inside the convolutions)
        return pred, self.head(captured[-1].to(self.head[0].weight.dtype))

    def save_pretrained(self, *args, **kwargs):
        return self.decoder.save_pretrained(*args, **kwargs)


def block_output_shape(decoder: UnCLIPDecoder, name: str, caption) -> tuple[int, int, int]:
    """``(channels, height, width)`` of the UNet block ``name``'s output at the decoder's sample
    size, from one forward pass at batch 1 (``caption``: one caption as the decoder takes them)."""
    block = named_submodule(decoder.unet, name, "repa.decoder_layer")
    seen = []
    handle = block.register_forward_hook(lambda _m, _a, out: seen.append(_block_output(out)))
    param = next(decoder.parameters())
    size = decoder.config.sample_size
    try:
        with torch.no_grad():
            decoder(
                torch.zeros(1, 3, size, size, device=param.device, dtype=param.dtype),
                torch.zeros(1, dtype=torch.long, device=param.device),
                torch.zeros(1, decoder.config.embed_dim, device=param.device),
                caption,
            )
    finally:
        handle.remove()
    if not seen or not isinstance(seen[0], torch.Tensor) or seen[0].ndim != 4:
        raise ValueError(
            f"repa.decoder_layer={name!r} outputs no [B, C, H, W] feature map; name one of "
            "mid_block, down_blocks.<i>, up_blocks.<i> or a resnet in them"
        )
    _, channels, height, width = seen[0].shape
    return channels, height, width


_HEAD, _DECODER = "head.", "decoder."


def exported_state(state: dict) -> dict:
    """A state dict of a :class:`RepaDecoder` (a training checkpoint's ``model.safetensors``) as
    the decoder's own: ``decoder.`` prefixes removed, the head left out; any other state dict is
    returned as it is."""
    if not any(k.startswith(_HEAD) for k in state) or not all(
        k.startswith((_HEAD, _DECODER)) for k in state
    ):
        return state
    return {k.removeprefix(_DECODER): v for k, v in state.items() if k.startswith(_DECODER)}


@overload
def exported_model(model: UnCLIPDecoder | RepaDecoder) -> UnCLIPDecoder: ...
@overload
def exported_model(model: nn.Module) -> nn.Module: ...
def exported_model(model: nn.Module) -> nn.Module:
    """The network a training run exports and loads initial weights into: the decoder inside a
    :class:`RepaDecoder`, else ``model`` itself."""
    return model.decoder if isinstance(model, RepaDecoder) else model
