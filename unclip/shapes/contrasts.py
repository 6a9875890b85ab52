"""The shapes world's rerank contrasts: every caption a wrong drawing of a prompt would match.

:func:`caption_alternatives` lists the captions that differ from a prompt in one attribute (and the
swaps of two objects' colors or shapes); :func:`region_parts` splits a two-object caption into one
phrase per side of the image. :func:`shapes_contrast` builds the scorers registered as the
decoder's ``rerank_contrast`` settings ``"shapes"``, ``"shapes-pairs"`` and
``"shapes-pairs-regions"`` (entry points in ``pyproject.toml``).
"""

from __future__ import annotations

import copy
import warnings

from unclip.sampling.scorers import ContrastScorer
from unclip.shapes.captions import canonical_caption, parse_caption
from unclip.shapes.regions import RegionContrastScorer, RegionPart
from unclip.shapes.world import BACKGROUNDS, COLORS, POSITIONS, RELATIONS, SHAPES, SIZES, palette


def caption_alternatives(text: str, extra_colors=None) -> list[str]:
    """``text`` in :func:`canonical_caption`'s phrasing, then every caption that differs from it in
    one attribute the caption names — another color, shape, size or position of an object, another
    background, another relation — and, for two objects, the two objects' colors or shapes
    swapped (how a drawing binds them wrongly: "a blue circle to the left of a red square" for "a
    red circle to the left of a blue square"). A color alternative never gives an object the
    other object's color. Contrastive reranking (:func:`unclip.sampling.rerank_candidates`) scores
    an image by how much a CLIP prefers the first caption over the others. Raises ``ValueError``
    for text that is not a shapes caption (:func:`parse_caption`)."""
    parsed = parse_caption(text, extra_colors)
    colors = list(palette(extra_colors) if extra_colors else COLORS)
    options = {"color": colors, "shape": SHAPES, "size": SIZES, "position": POSITIONS}
    objs = parsed["objects"]
    out = [canonical_caption(parsed)]

    def variant(change) -> None:
        q = copy.deepcopy(parsed)
        change(q)
        out.append(canonical_caption(q))

    for i, obj in enumerate(objs):
        for key, values in options.items():
            if obj.get(key) is None:
                continue
            taken = {o["color"] for o in objs} if key == "color" else {obj[key]}
            for v in values:
                if v not in taken:
                    variant(lambda q, i=i, key=key, v=v: q["objects"][i].__setitem__(key, v))
    if parsed["relation"] is not None:
        for r in RELATIONS:
            if r != parsed["relation"]:
                variant(lambda q, r=r: q.__setitem__("relation", r))
        for key in ("color", "shape"):
            if objs[0][key] != objs[1][key]:
                variant(
                    lambda q, key=key: (
                        q["objects"][0].__setitem__(key, objs[1][key]),
                        q["objects"][1].__setitem__(key, objs[0][key]),
                    )
                )
    if parsed["background"] is not None:
        for b in BACKGROUNDS:
            if b != parsed["background"]:
                variant(lambda q, b=b: q.__setitem__("background", b))
    return out


def region_parts(text: str, extra_colors=None) -> list:
    """The two objects of a two-object shapes caption as :class:`unclip.sampling.RegionPart` s
    (``[]`` for one object): along the relation's axis, the object that comes first (left or top)
    on the low side, as the single-object caption "a small red circle on the left" (with the
    prompt's background, if it names one), against the same object in each other color and each
    other shape. The CLIP that reranks reads one object's color and shape far more surely than it
    binds two objects' (docs/journal/shapes_model.md), and a drawing with the objects' colors or
    shapes swapped, or on the wrong sides, reads wrong on both sides. Raises ``ValueError`` for
    text that is not a shapes caption."""
    parsed = parse_caption(text, extra_colors)
    relation = parsed["relation"]
    if relation is None:
        return []
    horizontal = relation in ("to the left of", "to the right of")
    first_low = relation in ("to the left of", "above")
    objs = parsed["objects"] if first_low else parsed["objects"][::-1]
    colors = list(palette(extra_colors) if extra_colors else COLORS)

    def caption(color: str, shape: str, position: str) -> str:
        obj = {"shape": shape, "color": color, "size": "small", "position": position}
        return canonical_caption(
            {"background": parsed["background"], "relation": None, "objects": [obj]}
        )

    parts = []
    for obj, low in zip(objs, (True, False)):
        position = ("left" if low else "right") if horizontal else ("top" if low else "bottom")
        c, sh = obj["color"], obj["shape"]
        captions = [
            caption(c, sh, position),
            *(caption(o, sh, position) for o in colors if o != c),
            *(caption(c, o, position) for o in SHAPES if o != sh),
        ]
        parts.append(RegionPart("x" if horizontal else "y", low, tuple(captions)))
    return parts


def shapes_contrast(
    extra_colors=None, pairs_only: bool = False, regions: bool = False
) -> ContrastScorer:
    """A scorer for contrastive reranking (the decoder's ``rerank_contrast``;
    :func:`unclip.sampling.scorers.register_rerank_contrast` registers one under a name): the
    alternatives of a prompt are :func:`caption_alternatives`, with the world's ``extra_colors`` if
    it has any; calling it gives them. A prompt that is not a shapes caption gets no alternatives,
    so the plain CLIP score ranks it (with a warning). ``pairs_only``: single-object captions get
    none either: what the contrast reads better is which of two objects has which color and where,
    while a single object's attributes the cosine already reads (docs/journal/shapes_model.md).
    ``regions``: a :class:`~unclip.shapes.regions.RegionContrastScorer` that also reads each object
    of a two-object caption on its own side of the image (:func:`region_parts`)."""

    def alternatives(prompt: str) -> list[str]:
        try:
            single = parse_caption(prompt, extra_colors)["relation"] is None
        except ValueError:
            warnings.warn(
                f"rerank_contrast: {prompt!r} is not a shapes caption, so its candidates are "
                "ranked by the plain CLIP score",
                stacklevel=2,
            )
            return []
        return [] if single and pairs_only else caption_alternatives(prompt, extra_colors)

    if regions:
        # only prompts that parse reach it: unparsable ones get no alternatives, hence no regions
        return RegionContrastScorer(alternatives, lambda prompt: region_parts(prompt, extra_colors))
    return ContrastScorer(alternatives)


#: the ``rerank_contrast`` settings ``"shapes"``, ``"shapes-pairs"`` and ``"shapes-pairs-regions"``
#: (entry points in pyproject.toml)
contrast_all = shapes_contrast()
contrast_pairs = shapes_contrast(pairs_only=True)
contrast_pairs_regions = shapes_contrast(pairs_only=True, regions=True)
