"""How :meth:`UnCLIPPipeline.__call__ <unclip.pipeline.pipeline.UnCLIPPipeline.__call__>` splits
one call into groups of prompts that draw the same number of decoder candidates, and joins their
outputs back in prompt order; negative prompts as one per row.
"""

from __future__ import annotations

import torch

from unclip.diffusion.loop import Generator
from unclip.nets.text_encoding import check_prompts


def negatives_per_row(negative, rows: int, what: str) -> list[str]:
    """Negative prompts as one per row: one string (or a one-item list) serves every row, else
    there must be one per row (``what`` names the rows in the error: prompts, images)."""
    captions = check_prompts(negative, "negative_prompt")
    if len(captions) == 1:
        captions = captions * rows
    if len(captions) != rows:
        raise ValueError(
            f"negative_prompt: {len(captions)} for {rows} {what}; give one string for all, or one "
            "per prompt"
        )
    return captions


def generators_by_group(
    generator: Generator, prompts: int, n: int, groups: dict[int, list[int]], decoder
) -> dict[int, Generator]:
    """The generators of each group of prompts (:meth:`UnCLIPPipeline.__call__`): a single one is
    shared (drawn on group by group, in order of first appearance); a list of one per prompt or
    one per image is cut to the group's prompts."""
    if generator is None or isinstance(generator, torch.Generator) or len(groups) == 1:
        return dict.fromkeys(groups, generator)
    gens = list(generator)
    if len(gens) == prompts:
        return {k: [gens[i] for i in rows] for k, rows in groups.items()}
    if len(gens) == prompts * n:
        return {k: [gens[i * n + j] for i in rows for j in range(n)] for k, rows in groups.items()}
    raise ValueError(
        f"generator: got {len(gens)} generators for {prompts} prompts × {n} images (the decoder "
        f"draws {decoder.best_of} candidates per image, or {decoder.best_of_contrasted} for a "
        "prompt its rerank_contrast has alternatives for); pass one generator, one per prompt, "
        "or one per image"
    )


def joined_outputs(parts: list[tuple], order: list[int]) -> tuple:
    """The outputs of the groups of :meth:`UnCLIPPipeline.__call__` put back in prompt order
    (``order``: each output row's position among all the prompts' images); timings summed."""
    if len(parts) == 1:
        return parts[0]
    back = torch.tensor(order).argsort()

    def cat(values):
        return torch.cat(values)[back.to(values[0].device)]

    final, embeds, text_embeds, stages, _ = zip(*parts)
    timings: dict[str, float] = {}
    for part in parts:
        for stage, seconds in part[4].items():
            timings[stage] = timings.get(stage, 0.0) + seconds
    stage_images = {name: cat([p[name] for p in stages]) for name in stages[0]}
    return cat(list(final)), cat(list(embeds)), cat(list(text_embeds)), stage_images, timings
