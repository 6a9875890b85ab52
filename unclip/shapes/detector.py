"""Read the attributes of a shapes image back from its pixels, and score images against captions.

The evaluator needs no model: it classifies pixels by their nearest reference color, so it works on
ground-truth renders and on generated samples at any resolution.

Algorithm (:func:`detect`)
--------------------------
1. Images larger than ``max_side`` (default 128) are box-filtered down to it. Noisy images (median
   distance of border pixels to the nearest reference color > ``NOISY_BORDER``, e.g. generated
   samples with grain) are 3x3 median-filtered, unless smaller than 48 px where that erodes the
   shapes (``median=None``: auto; True/False forces it). Detection is reliable from 64 px up.
2. Every pixel gets the nearest of the 6 palette colors (and any ``extra_colors``) and 3 background
   colors (Euclidean sRGB distance). A pixel belongs to a palette color if that color is the nearest
   and closer than ``color_threshold`` (default 70). Anti-aliased edges and noise fall outside.
3. The background is the majority nearest background color of the border ring of pixels.
4. Per palette color, 4-connected components smaller than ``min_area`` (default 0.4% of the image)
   or thinner on average than ``min_thickness`` pixels (area / longest bbox side; drops the 1-pixel
   lines that anti-aliased edges leave, e.g. yellow-ish rims of orange squares) are dropped; each
   remaining component is an object.
5. For each object: ``extent`` = bbox width / W -> nearest ``SIZES`` class; ``center`` = bbox centre
   -> nearest ``POSITIONS`` class; shape = nearest prototype in (fill ratio of the bbox, fraction of
   mass in the bottom half of the bbox): square (1.0, 0.5), circle (pi/4, 0.5), triangle (0.5,
   0.75).
6. With exactly two objects, ``relation`` is the relation of the first to the second along the
   dominant axis of the displacement between their centres. Objects are sorted by area, largest
   first.

Scoring (:func:`score`) against an ``expected`` dict from :func:`unclip.shapes.world.parse_caption`
-----------------------------------------------------------------------------------------------
* Single-object prompts: the object judged is the largest detected object of the expected color, or
  the largest object if there is none; keys ``color``, ``shape``, ``size``, ``position`` (each only
  if the caption names it), ``background`` (only if named), ``objects`` (exactly one object
  detected) and ``all`` (every key above true).
* Two-object prompts: each expected object is matched to the largest detected object of its color;
  ``colors`` = both colors found, ``shapes`` = both matched objects have their expected shapes,
  ``relation`` = the relation between the matched centres is the expected one, ``background`` if
  named, ``objects`` = exactly two objects detected, ``all`` = all of these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import numpy as np
from PIL import Image, ImageFilter

from unclip.shapes.captions import parse_caption
from unclip.shapes.world import BACKGROUNDS, COLORS, POSITIONS, SIZES, palette

_COLOR_NAMES = list(COLORS)
_BG_NAMES = list(BACKGROUNDS)
_REFS = np.array(
    [COLORS[c] for c in _COLOR_NAMES] + [BACKGROUNDS[b] for b in _BG_NAMES], dtype=np.float32
)


def _references(extra_colors) -> tuple[list[str], np.ndarray]:
    """The object color names and the reference colors (object colors, then backgrounds)."""
    if not extra_colors:
        return _COLOR_NAMES, _REFS
    colors = palette(extra_colors)
    names = list(colors)
    refs = [colors[c] for c in names] + [BACKGROUNDS[b] for b in _BG_NAMES]
    return names, np.array(refs, dtype=np.float32)


#: (fill ratio of bbox, fraction of mass in the bottom half of bbox) per shape.
SHAPE_PROTOTYPES: dict[str, tuple[float, float]] = {
    "square": (1.0, 0.5),
    "circle": (math.pi / 4, 0.5),
    "triangle": (0.5, 0.75),
}
#: Median distance (sRGB) of border pixels to the nearest reference color above which ``detect``
#: median-filters the image first (``median=None``).
NOISY_BORDER = 12.0


def _to_array(image) -> np.ndarray:
    """PIL image or uint8 array ``[H, W, 3]`` -> uint8 array ``[H, W, 3]``."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"image array must have shape [H, W, 3], got {arr.shape}")
    if arr.dtype != np.uint8:
        raise TypeError(
            f"image array must be uint8 (0..255), got {arr.dtype}; convert tensors in [-1, 1] first"
        )
    return arr


def _components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """4-connected components of a boolean mask ``[H, W]`` -> (labels ``[H, W]`` with -1 outside,
    count)."""
    h, w = mask.shape
    big = h * w
    labels = np.where(mask, np.arange(big).reshape(h, w), big)
    while True:  # propagate the minimum label through each component
        new = labels.copy()
        new[1:, :] = np.minimum(new[1:, :], labels[:-1, :])
        new[:-1, :] = np.minimum(new[:-1, :], labels[1:, :])
        new[:, 1:] = np.minimum(new[:, 1:], labels[:, :-1])
        new[:, :-1] = np.minimum(new[:, :-1], labels[:, 1:])
        new = np.where(mask, new, big)
        if np.array_equal(new, labels):
            break
        labels = new
    ids, dense = np.unique(labels[mask], return_inverse=True)
    out = np.full((h, w), -1, dtype=np.int64)
    out[mask] = dense
    return out, len(ids)


def nearest(value: Union[float, Sequence[float]], classes: dict) -> str:
    """Name of the class whose value (a scalar range ``(lo, hi)`` or a point ``(x, y)``) is
    nearest."""

    def dist(ref):
        if isinstance(value, (int, float)):
            lo, hi = ref
            return max(lo - value, 0.0, value - hi)
        return math.dist(value, ref)

    return min(classes, key=lambda k: dist(classes[k]))


def relation_between(first_center, second_center) -> str:
    """Relation of ``first`` to ``second`` (centres ``[x, y]``) along the dominant axis."""
    dx = first_center[0] - second_center[0]
    dy = first_center[1] - second_center[1]
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "above" if dy < 0 else "below"


def classify_shape(fill: float, bottom: float) -> str:
    """Nearest shape prototype for a mask's bbox fill ratio and bottom-half mass fraction."""
    return min(SHAPE_PROTOTYPES, key=lambda s: math.dist((fill, bottom), SHAPE_PROTOTYPES[s]))


def detect(
    image,
    *,
    max_side: int = 128,
    color_threshold: float = 70.0,
    min_area: float = 0.004,
    min_thickness: float = 2.0,
    median: bool | None = None,
    extra_colors: dict | None = None,
) -> dict:
    """Detect background and objects of a shapes image (PIL or uint8 ``[H, W, 3]``, any resolution).
    ``extra_colors``: named colors beyond the spec's six (:mod:`unclip.shapes.world`) that are also
    reference colors of step 2.

    Returns ``{"background", "relation", "objects": [{"shape", "color", "size", "position",
    "center", "bbox", "extent", "area"}]}`` with geometry in fractions of W and H (as in the ground
    truth).
    """
    arr = _to_array(image)
    color_names, refs = _references(extra_colors)
    if max(arr.shape[:2]) > max_side:
        h, w = arr.shape[:2]
        scale = max_side / max(h, w)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        arr = np.asarray(Image.fromarray(arr).resize(size, Image.Resampling.BOX))
    if median is None:  # auto: denoise only if the border (mostly background) is visibly noisy
        border = np.concatenate([arr[0], arr[-1], arr[1:-1, 0], arr[1:-1, -1]]).astype(np.float32)
        noise = np.sqrt(((border[:, None] - refs[None]) ** 2).sum(-1).min(-1))
        median = (
            bool(np.median(noise) > NOISY_BORDER) and min(arr.shape[:2]) >= 48
        )  # hurts tiny images
    if median:
        arr = np.asarray(Image.fromarray(arr).filter(ImageFilter.MedianFilter(3)))
    h, w = arr.shape[:2]
    d2 = ((arr[:, :, None, :].astype(np.float32) - refs[None, None]) ** 2).sum(-1)  # [H, W, R]
    near = d2.argmin(-1)
    ring = np.concatenate([near[0], near[-1], near[1:-1, 0], near[1:-1, -1]])
    ring_d2 = np.concatenate([d2[0], d2[-1], d2[1:-1, 0], d2[1:-1, -1]])
    k = len(color_names)
    bg_votes = ring_d2[:, k:].argmin(-1)
    votes = bg_votes[ring >= k] if (ring >= k).any() else bg_votes
    background = _BG_NAMES[int(np.bincount(votes, minlength=len(_BG_NAMES)).argmax())]

    close = d2.min(-1) < color_threshold**2
    min_pixels = max(4, int(min_area * h * w))
    objects = []
    for ci, cname in enumerate(color_names):
        mask = (near == ci) & close
        if mask.sum() < min_pixels:
            continue
        labels, n = _components(mask)
        for k in range(n):
            ys, xs = np.nonzero(labels == k)
            x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
            bw, bh = x1 - x0, y1 - y0
            if len(ys) < min_pixels or len(ys) < min_thickness * max(bw, bh):
                continue  # too small, or a thin line (anti-aliased edge of another color)
            fill = len(ys) / float(bw * bh)
            bottom = float((ys + 0.5 >= (y0 + y1) / 2).mean())
            center = [float((x0 + x1) / 2 / w), float((y0 + y1) / 2 / h)]
            extent = bw / w
            objects.append(
                {
                    "shape": classify_shape(fill, bottom),
                    "color": cname,
                    "size": nearest(extent, SIZES),
                    "position": nearest(center, POSITIONS),
                    "center": center,
                    "bbox": [float(x0 / w), float(y0 / h), float(x1 / w), float(y1 / h)],
                    "extent": float(extent),
                    "area": len(ys) / (h * w),
                }
            )
    objects.sort(key=lambda o: -o["area"])
    relation = (
        relation_between(objects[0]["center"], objects[1]["center"]) if len(objects) == 2 else None
    )
    return {"background": background, "relation": relation, "objects": objects}


def _largest_of_color(objects: list[dict], color: str):
    found = [o for o in objects if o["color"] == color]
    return found[0] if found else None


def score(image, expected: dict, **detect_kwargs) -> dict[str, bool]:
    """Score one image against ``expected`` (a :func:`parse_caption` result); see module
    docstring."""
    if not isinstance(expected, dict) or "objects" not in expected:
        raise TypeError(
            "expected must be a parse_caption() dict with 'objects', 'relation', 'background'"
        )
    det = detect(image, **detect_kwargs)
    objs = det["objects"]
    out: dict[str, bool] = {}
    want = expected["objects"]
    if len(want) == 1:
        exp = want[0]
        obj = _largest_of_color(objs, exp["color"]) or (objs[0] if objs else None)
        for key in ("color", "shape", "size", "position"):
            if exp.get(key) is not None:
                out[key] = obj is not None and obj[key] == exp[key]
        count_ok = len(objs) == 1
    elif len(want) == 2:
        matched = [_largest_of_color(objs, e["color"]) for e in want]
        out["colors"] = all(m is not None for m in matched)
        out["shapes"] = all(
            m is not None and m["shape"] == e["shape"] for m, e in zip(matched, want)
        )
        out["relation"] = (
            out["colors"]
            and matched[0] is not matched[1]
            and relation_between(matched[0]["center"], matched[1]["center"]) == expected["relation"]
        )
        count_ok = len(objs) == 2
    else:
        raise ValueError(f"expected must name one or two objects, got {len(want)}")
    if expected.get("background") is not None:
        out["background"] = det["background"] == expected["background"]
    out["objects"] = count_ok
    out["all"] = all(out.values())
    return out


def evaluate_images(images, captions, extra_colors: dict | None = None, **detect_kwargs) -> dict:
    """Aggregate :func:`score` over images (PIL or uint8 ``[H, W, 3]``) and their captions.
    ``extra_colors``: named colors beyond the spec's that the captions may name and the detector
    reads (:mod:`unclip.shapes.world`).

    Returns ``{"single": {"count": n, <key>: fraction, "<key>_count": n_scored ...}, "pair": {...},
    "count": total, "all": fraction of all images fully correct}``. Each key's fraction is over the
    prompts that score it (``background`` only over captions that name a background); a kind with no
    prompts has ``count`` 0 and no fractions.
    """
    images, captions = list(images), list(captions)
    if len(images) != len(captions):
        raise ValueError(f"got {len(images)} images but {len(captions)} captions")
    sums: dict[str, dict[str, int]] = {"single": {}, "pair": {}}
    scored: dict[str, dict[str, int]] = {"single": {}, "pair": {}}
    counts = {"single": 0, "pair": 0}
    for i, (image, caption) in enumerate(zip(images, captions)):
        try:
            expected = parse_caption(caption, extra_colors)
        except ValueError as e:
            raise ValueError(f"caption {i}: {e}") from None
        kind = "single" if len(expected["objects"]) == 1 else "pair"
        counts[kind] += 1
        for key, ok in score(image, expected, extra_colors=extra_colors, **detect_kwargs).items():
            sums[kind][key] = sums[kind].get(key, 0) + int(ok)
            scored[kind][key] = scored[kind].get(key, 0) + 1
    report: dict = {}
    for kind in ("single", "pair"):
        row: dict = {"count": counts[kind]}
        for key, total in sums[kind].items():
            row[key] = total / scored[kind][key]
            row[f"{key}_count"] = scored[kind][key]
        report[kind] = row
    n = counts["single"] + counts["pair"]
    report["count"] = n
    report["all"] = (
        (sums["single"].get("all", 0) + sums["pair"].get("all", 0)) / n if n else float("nan")
    )
    return report
