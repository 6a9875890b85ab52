"""Region reading for contrastive reranking: phrases of a prompt read on one side of the image.

A CLIP that reads one object well but binds two objects' attributes less surely (which color or
shape goes with which object) is asked the easier question once per object: each
:class:`RegionPart` is a phrase of the prompt read on one side of the image, the other side
painted in the background (:func:`region_views`), and a candidate's score gains the parts'
summed ``log p(caption | side)`` at the split that suits it best (:data:`REGION_SPLITS`).
:class:`RegionContrastScorer` is a :class:`~unclip.sampling.scorers.ContrastScorer` with that
term; the shapes world's ``"shapes-pairs-regions"`` contrast is one
(:mod:`unclip.shapes.contrasts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.nn.functional as F

from unclip.nets.clip import CLIP
from unclip.sampling.scorers import ContrastScorer


@dataclasses.dataclass(frozen=True)
class RegionPart:
    """One phrase of a prompt, read on one side of the image (:class:`RegionContrastScorer`):
    ``axis`` ``"x"`` (columns) or ``"y"`` (rows); ``low``: the side before the split (left or
    top) rather than after it; ``captions``: the phrase as a caption of its own first, then its
    alternatives."""

    axis: str
    low: bool
    captions: tuple[str, ...]

    def __post_init__(self):
        if self.axis not in ("x", "y"):
            raise ValueError(f"RegionPart.axis must be 'x' or 'y', got {self.axis!r}")
        if not isinstance(self.low, bool):
            raise TypeError(f"RegionPart.low must be True (left/top) or False, got {self.low!r}")
        if isinstance(self.captions, str):
            raise TypeError("RegionPart.captions: a sequence of captions, not one string")
        object.__setattr__(self, "captions", tuple(self.captions))
        if len(self.captions) < 2:
            raise ValueError(
                "RegionPart.captions: the part's caption and at least one alternative, got "
                f"{list(self.captions)!r}"
            )


#: where a contrast's region parts split the image (fractions of its width or height); each
#: candidate counts at its best split, since a prompt such as "a circle to the left of a square"
#: fixes the order of its objects, not where between them the boundary lies
REGION_SPLITS = (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7)


def region_views(images: torch.Tensor, axis: str, low: bool, splits=REGION_SPLITS) -> torch.Tensor:
    """``[len(splits), B, 3, H, W]``: ``images [B, 3, H, W]`` with everything on the other side of
    each split painted in the image's background, taken as the per-channel median of its border
    pixels (the regions are meant for flat backgrounds, as in the shapes world)."""
    if axis not in ("x", "y"):
        raise ValueError(f"region_views: axis must be 'x' or 'y', got {axis!r}")
    size = images.shape[-1] if axis == "x" else images.shape[-2]
    border = torch.cat(
        [images[..., 0, :], images[..., -1, :], images[..., :, 0], images[..., :, -1]], -1
    )
    fill = border.median(-1).values[..., None, None]
    centres = (torch.arange(size, device=images.device) + 0.5) / size
    shape = (1, 1, 1, size) if axis == "x" else (1, 1, size, 1)
    views = []
    for split in splits:
        keep = ((centres < split) == low).view(shape)
        views.append(torch.where(keep, images, fill))
    return torch.stack(views)


def region_scores(clip: CLIP, images, parts: Sequence[RegionPart]) -> torch.Tensor:
    """``[B]``: at the split that suits each image best, the sum over ``parts`` of ``log p(part's
    caption | the image masked to the part's side)`` among the part's captions."""
    if not parts:
        raise ValueError("region_scores: no parts to read (a prompt without regions has none)")
    total = torch.zeros(len(REGION_SPLITS), images.shape[0], device=clip.device)
    for part in parts:
        if not isinstance(part, RegionPart):
            raise TypeError(f"region parts are RegionPart objects, got {type(part).__name__}")
        txt = F.normalize(clip.encode_text(list(part.captions)).text_embed.float(), dim=-1)
        # encoded one split at a time: B views per encoding, as many as the candidates themselves
        for i, view in enumerate(region_views(images, part.axis, part.low)):
            img = F.normalize(clip.encode_image(view).float(), dim=-1)
            logp = ((img @ txt.to(img).T) * clip.logit_scale).log_softmax(-1)[:, 0]
            total[i] += logp.to(total.device)
    return total.max(0).values


class RegionContrastScorer(ContrastScorer):
    """:class:`~unclip.sampling.scorers.ContrastScorer` of ``alternatives`` plus, for each prompt
    scored by the contrast, :func:`region_scores` of ``regions(prompt)`` (a list of
    :class:`RegionPart`; empty: no region term for that prompt)."""

    def __init__(
        self,
        alternatives: Callable[[str], Sequence[str]],
        regions: Callable[[str], Sequence[RegionPart]],
    ):
        super().__init__(alternatives)
        if not callable(regions):
            raise TypeError(
                f"RegionContrastScorer(regions): a function prompt -> [RegionPart, ...], got "
                f"{type(regions).__name__}"
            )
        self.regions = regions

    def extra(self, clip, images: torch.Tensor, prompt: str) -> Optional[torch.Tensor]:
        parts = list(self.regions(prompt))
        return region_scores(clip, images, parts) if parts else None
