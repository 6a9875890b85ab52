"""The built-in "shapes" caption dataset (spec: ``specs/shapes.md``).

A procedural text–image world so that every stage can be trained, tested and evaluated offline:
one or two flat, anti-aliased shapes on a flat background, a caption describing them, and the
ground truth of every image.

Conventions
-----------
* All geometry is in fractions of the image: ``x`` of the width W (left = 0), ``y`` of the height H
  (top = 0). Images are square, ``resolution x resolution`` RGB.
* ``extent`` is the diameter (circle), side (square) or base (triangle) as a fraction of W.
  Triangles are equilateral, apex up: height = extent * sqrt(3) / 2.
* An object's ``center`` is the centre of its bounding box (for a triangle: half its height, not its
  centroid); ``bbox`` is ``[x0, y0, x1, y1]``.
* Single objects sit at a named position, jittered by up to ±0.04 on each axis; the jitter range is
  narrowed where needed so that the object lies fully inside the image (with a 0.01 margin).
* Two objects are both small, of different colors, with bounding boxes at least 0.02 apart; the
  first object's centre is at least 0.25·W (or H) from the second's along the relation axis, and at
  most 0.1 off along the other axis, so the relation is unambiguous.
* A scene is a pure function of ``(seed, split, index)``; the resolution only changes the rendering.

Extra colors (an opt-in extension of the spec)
----------------------------------------------
``extra_colors={"pink": (255, 105, 180)}`` (:class:`ShapesWorld`, :func:`sample_truth`,
:func:`render`, :func:`parse_caption`, :func:`write_shapes`, and the detector) adds named colors to
the six of the spec: objects draw their color from the extended palette, captions name it, the
parser and the detector read it. A new name must be one lowercase word that is not already a word of
the world, and its RGB at least :data:`UNNAMED_COLOR_MIN_DISTANCE` from every color and background
(so the detector cannot confuse them). Without ``extra_colors`` every output is the spec's, bit for
bit; with them the random draws differ (the palette is larger), so the scenes of a seed differ too.
The held-out combinations are unchanged (no extra color is held out).

Held-out split
--------------
``HELDOUT_COMBINATIONS`` lists attribute combinations that never occur in the ``"train"`` split. A
scene is held out iff one of its objects matches one of them (all keys of the combination equal).
The ``"heldout"`` split is built by construction from these combinations, ``"train"`` by
deterministic rejection, ``"all"`` samples the whole world.

Files written by :func:`write_shapes`
-------------------------------------
* ``folder``: ``{index:08d}.png`` (or ``.jpg``), ``{index:08d}.txt`` (caption), ``{index:08d}.json``
  (truth).
* ``webdataset``: img2dataset layout, ``{shard:05d}.tar`` holding ``{key}.png|jpg``, ``{key}.txt``,
  ``{key}.json`` (``{"key", "caption", "truth", ...}``) plus ``{shard:05d}_stats.json``.
"""

from __future__ import annotations

import math
import operator
import random
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw

from unclip._compat import package_getattr

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 180, 70),
    "blue": (40, 90, 230),
    "yellow": (245, 215, 50),
    "purple": (150, 60, 210),
    "orange": (250, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "gray": (128, 128, 128),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: dict[str, tuple[float, float]] = {"small": (0.22, 0.28), "large": (0.45, 0.55)}
POSITIONS: dict[str, tuple[float, float]] = {
    "center": (0.5, 0.5),
    "left": (0.27, 0.5),
    "right": (0.73, 0.5),
    "top": (0.5, 0.27),
    "bottom": (0.5, 0.73),
}
RELATIONS: tuple[str, ...] = ("to the left of", "to the right of", "above", "below")
SPLITS: tuple[str, ...] = ("train", "heldout", "all")

#: Attribute combinations never seen in training. An object matches one when all its keys agree.
HELDOUT_COMBINATIONS: tuple[dict[str, str], ...] = (
    {"color": "red", "shape": "triangle"},
    {"color": "blue", "shape": "circle"},
    {"color": "yellow", "shape": "square"},
    {"shape": "square", "position": "bottom"},
)

POSITION_PHRASES: dict[str, str] = {
    "center": "in the center",
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {
    "small": ("small", "tiny", "little"),
    "large": ("large", "big"),
}
JITTER = 0.04
MARGIN = 0.01
MIN_SEPARATION = 0.25
PAIR_GAP = 0.02
PAIR_MAX_OFF_AXIS = 0.1
TRIANGLE_HEIGHT = math.sqrt(3.0) / 2.0
_SINGLE_TEMPLATES = (
    "{obj} {pos}{bg}",
    "{pos}, {obj}{bg}",
    "there is {obj} {pos}{bg}",
    "an image of {obj} {pos}{bg}",
)
_PAIR_TEMPLATES = (
    "{a} {rel} {b}{bg}",
    "there is {a} {rel} {b}{bg}",
    "an image of {a} {rel} {b}{bg}",
)


@dataclass
class ShapesSample:
    """One sample: ``image`` (PIL RGB, resolution x resolution), ``caption`` and ``truth``
    (JSON-able)."""

    image: Image.Image
    caption: str
    truth: dict


def article(word: str) -> str:
    """English indefinite article for ``word``: ``"an"`` before a vowel sound, else ``"a"``."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def half_size(shape: str, extent: float) -> tuple[float, float]:
    """Half width and half height of a shape's bounding box, as fractions of the image side."""
    if shape == "triangle":
        return extent / 2.0, extent * TRIANGLE_HEIGHT / 2.0
    return extent / 2.0, extent / 2.0


def matches_combination(obj: dict, combination: dict) -> bool:
    """True iff every attribute named in ``combination`` equals the object's."""
    return all(obj.get(k) == v for k, v in combination.items())


def is_heldout(scene: dict) -> bool:
    """True iff an object of ``scene`` (a truth or :func:`parse_caption` dict) shows a held-out
    combination."""
    return any(matches_combination(o, c) for o in scene["objects"] for c in HELDOUT_COMBINATIONS)


def _object(shape, color, size, position, cx, cy, extent) -> dict:
    hx, hy = half_size(shape, extent)
    return {
        "shape": shape,
        "color": color,
        "size": size,
        "position": position,
        "center": [round(cx, 6), round(cy, 6)],
        "bbox": [round(cx - hx, 6), round(cy - hy, 6), round(cx + hx, 6), round(cy + hy, 6)],
        "extent": round(extent, 6),
    }


def _pair_applicable(combination: dict) -> bool:
    return "position" not in combination and combination.get("size", "small") == "small"


def check_extra_colors(extra_colors) -> dict[str, tuple[int, int, int]]:
    """Validate ``extra_colors`` (``{name: (r, g, b)}`` or None) and return it as a dict (``{}`` for
    None); a ``ValueError`` names what is wrong (see the module doc)."""
    if extra_colors is None:
        return {}
    if not isinstance(extra_colors, dict):
        raise ValueError(
            f"extra_colors must map color names to RGB triples, got {type(extra_colors).__name__}"
        )
    taken = set(caption_vocabulary())
    out: dict[str, tuple[int, int, int]] = {}
    for name, rgb in extra_colors.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z]+", name) or name in taken:
            raise ValueError(
                f"extra color name {name!r} must be one lowercase word that is not already a word "
                "of the shapes world (a color, shape, size, position, relation or background word)"
            )
        if (
            not isinstance(rgb, (list, tuple))
            or len(rgb) != 3
            or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in rgb
            )
        ):
            raise ValueError(f"extra color {name!r}: RGB must be three integers 0-255, got {rgb!r}")
        rgb = tuple(rgb)
        refs = {**COLORS, **BACKGROUNDS, **out}
        near = min(refs, key=lambda k: math.dist(rgb, refs[k]))
        if math.dist(rgb, refs[near]) < UNNAMED_COLOR_MIN_DISTANCE:
            raise ValueError(
                f"extra color {name!r} {rgb} is {math.dist(rgb, refs[near]):.0f} from {near} "
                f"{refs[near]}; it must be at least {UNNAMED_COLOR_MIN_DISTANCE:.0f} from every "
                "color and background so the detector can tell them apart"
            )
        out[name] = rgb
    return out


def palette(extra_colors=None) -> dict[str, tuple[int, int, int]]:
    """The named colors: the spec's :data:`COLORS` plus ``extra_colors`` (validated)."""
    return {**COLORS, **check_extra_colors(extra_colors)}


def _sample_attributes(
    rng: random.Random, split: str, pair: bool, colors: dict = COLORS
) -> list[dict]:
    """Attribute dicts (shape, color, size, position) for one scene of ``split``, colors drawn from
    ``colors``."""

    def draw() -> list[dict]:
        if pair:
            c1, c2 = rng.sample(sorted(colors), 2)
            return [
                {"shape": rng.choice(SHAPES), "color": c, "size": "small", "position": None}
                for c in (c1, c2)
            ]
        return [
            {
                "shape": rng.choice(SHAPES),
                "color": rng.choice(sorted(colors)),
                "size": rng.choice(sorted(SIZES)),
                "position": rng.choice(sorted(POSITIONS)),
            }
        ]

    if split == "all":
        return draw()
    if split == "train":
        for _ in range(10_000):
            objs = draw()
            if not is_heldout({"objects": objs}):
                return objs
        raise AssertionError("rejection sampling of a training scene did not terminate")
    # heldout: pick a combination uniformly, impose it on one object, fill the rest at random.
    candidates = [c for c in HELDOUT_COMBINATIONS if not pair or _pair_applicable(c)]
    combo = rng.choice(candidates)
    objs = draw()
    k = rng.randrange(len(objs))
    objs[k].update(combo)
    if pair and objs[0]["color"] == objs[1]["color"]:
        other = 1 - k
        objs[other]["color"] = rng.choice(sorted(set(colors) - {objs[k]["color"]}))
    assert is_heldout({"objects": objs})
    return objs


def _place_single(rng: random.Random, obj: dict) -> dict:
    extent = rng.uniform(*SIZES[obj["size"]])
    hx, hy = half_size(obj["shape"], extent)
    px, py = POSITIONS[obj["position"]]
    cx = rng.uniform(max(px - JITTER, hx + MARGIN), min(px + JITTER, 1 - hx - MARGIN))
    cy = rng.uniform(max(py - JITTER, hy + MARGIN), min(py + JITTER, 1 - hy - MARGIN))
    return _object(obj["shape"], obj["color"], obj["size"], obj["position"], cx, cy, extent)


def _place_pair(rng: random.Random, objs: list[dict], relation: str) -> list[dict]:
    axis = 0 if relation in ("to the left of", "to the right of") else 1
    sign = (
        -1.0 if relation in ("to the left of", "above") else 1.0
    )  # sign of (first - second) on axis
    for _ in range(10_000):
        extents = [rng.uniform(*SIZES["small"]) for _ in objs]
        halves = [half_size(o["shape"], e) for o, e in zip(objs, extents)]
        need = max(MIN_SEPARATION, halves[0][axis] + halves[1][axis] + PAIR_GAP)
        sep = rng.uniform(need, need + 0.3)
        off = rng.uniform(-PAIR_MAX_OFF_AXIS, PAIR_MAX_OFF_AXIS)
        second = [rng.uniform(0, 1), rng.uniform(0, 1)]
        first = list(second)
        first[axis] += sign * sep
        first[1 - axis] += off
        centers = (first, second)
        if all(
            h[i] + MARGIN <= c[i] <= 1 - h[i] - MARGIN
            for c, h in zip(centers, halves)
            for i in (0, 1)
        ):
            return [
                _object(o["shape"], o["color"], "small", None, c[0], c[1], e)
                for o, c, e in zip(objs, centers, extents)
            ]
    raise AssertionError("placement of a two-object scene did not terminate")


def _scene(rng: random.Random, objs: list[dict], relation: str | None, background: str) -> dict:
    """A scene's ground truth: ``objs`` (attribute dicts) placed with ``rng``, as a pair in
    ``relation`` or alone (``relation`` None)."""
    placed = (
        _place_pair(rng, objs, relation) if relation is not None else [_place_single(rng, objs[0])]
    )
    return {"background": background, "relation": relation, "objects": placed}


def sample_truth(
    rng: random.Random, split: str = "all", two_object_prob: float = 0.3, extra_colors=None
) -> dict:
    """Draw one scene's ground truth with ``rng`` (see module docstring for the structure), object
    colors from the spec's palette plus ``extra_colors``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    colors = palette(extra_colors) if extra_colors else COLORS
    background = rng.choice(sorted(BACKGROUNDS))
    pair = rng.random() < two_object_prob
    objs = _sample_attributes(rng, split, pair, colors)
    return _scene(rng, objs, rng.choice(RELATIONS) if pair else None, background)


#: Which attribute :func:`contrast_truth` changes, with weights: single-object scenes, two-object
#: scenes. (No background by default: captions name the background only half of the time, so a
#: background twin's caption would often be the same sentence as its sibling's.)
CONTRAST_SINGLE: dict[str, float] = {"shape": 0.6, "position": 0.2, "size": 0.1, "color": 0.1}
CONTRAST_PAIR: dict[str, float] = {"relation": 0.6, "shape": 0.3, "color": 0.1}
#: Every attribute :func:`contrast_truth` can change: single-object scenes, two-object scenes.
CONTRAST_ATTRIBUTES_SINGLE = ("shape", "position", "size", "color", "background")
CONTRAST_ATTRIBUTES_PAIR = ("relation", "shape", "color", "background", "swap")


def _in_split(objs: list[dict], split: str) -> bool:
    held = is_heldout({"objects": objs})
    return not (split == "train" and held) and not (split == "heldout" and not held)


def contrast_truth(
    truth: dict, rng: random.Random, split: str = "train", weights: dict[str, float] | None = None
) -> tuple[dict, str]:
    """A scene that differs from ``truth`` in one attribute (or, for ``swap``, in which object has
    which color), for contrastive hard negatives.

    Returns ``(new_truth, attribute)``. The attribute is drawn with ``weights`` (default
    :data:`CONTRAST_SINGLE` or :data:`CONTRAST_PAIR`): ``shape``, ``color``, ``size`` and
    ``position`` change one object (the object is placed afresh, so its exact centre moves too);
    ``relation`` places the same two objects in another relation; ``background`` changes only the
    background; ``swap`` (two objects) exchanges the two objects' colors and nothing else, so the
    same colors and shapes appear bound the other way round. The new scene stays in ``split`` (a
    change that would make a ``"train"`` scene show a held-out combination is not drawn) and keeps
    the two objects' colors different.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    pair = truth["relation"] is not None
    weights = weights or (CONTRAST_PAIR if pair else CONTRAST_SINGLE)
    allowed = set(CONTRAST_ATTRIBUTES_PAIR if pair else CONTRAST_ATTRIBUTES_SINGLE)
    if not weights or set(weights) - allowed:
        raise ValueError(
            f"weights must name attributes among {sorted(allowed)}, got {sorted(weights)}"
        )
    objs = [{k: o[k] for k in ("shape", "color", "size", "position")} for o in truth["objects"]]
    for _ in range(1000):
        attr = rng.choices(list(weights), weights=list(weights.values()))[0]
        if attr == "background":
            bg = rng.choice(sorted(set(BACKGROUNDS) - {truth["background"]}))
            return {**truth, "background": bg}, attr
        if attr == "relation":
            rel = rng.choice([r for r in RELATIONS if r != truth["relation"]])
            return _scene(rng, objs, rel, truth["background"]), attr
        if attr == "swap":
            a, b = truth["objects"]
            new = [{**a, "color": b["color"]}, {**b, "color": a["color"]}]
            if _in_split(new, split):
                # the layout is kept: only the binding of color to shape changes
                return {**truth, "objects": new}, attr
            continue
        k = rng.randrange(len(objs))
        options = {
            "shape": SHAPES,
            "color": sorted(COLORS),
            "size": sorted(SIZES),
            "position": sorted(POSITIONS),
        }[attr]
        taken = {o["color"] for o in objs} if attr == "color" else {objs[k][attr]}
        new = [dict(o) for o in objs]
        new[k][attr] = rng.choice([v for v in options if v not in taken])
        if not _in_split(new, split):
            continue
        return _scene(rng, new, truth["relation"], truth["background"]), attr
    raise ValueError(
        f"no one-attribute change of this scene stays in split {split!r} with weights {weights}"
    )


def render(truth: dict, resolution: int = 64, fills=None, extra_colors=None) -> Image.Image:
    """Draw ``truth`` as a ``resolution x resolution`` RGB image (flat colors, anti-aliased edges).

    Drawn at up to 4x the resolution with ``PIL.ImageDraw`` and reduced with a box filter. ``fills``
    (one RGB triple per object) paints the objects in those colors instead of their named ones;
    ``extra_colors`` names colors beyond the spec's (module doc).
    """
    colors = palette(extra_colors) if extra_colors else COLORS
    if not isinstance(resolution, int) or resolution < 8:
        raise ValueError(f"resolution must be an int >= 8, got {resolution!r}")
    if fills is not None and len(fills) != len(truth["objects"]):
        raise ValueError(
            f"fills needs one RGB color per object ({len(truth['objects'])}), got {len(fills)}"
        )
    factor = max(1, min(4, 4096 // resolution))
    side = resolution * factor
    canvas = Image.new("RGB", (side, side), BACKGROUNDS[truth["background"]])
    draw = ImageDraw.Draw(canvas)
    for i, obj in enumerate(truth["objects"]):
        if fills is None and obj["color"] not in colors:
            raise ValueError(
                f"unknown color {obj['color']!r}; pass extra_colors to render colors beyond "
                f"{sorted(COLORS)}"
            )
        fill = tuple(fills[i]) if fills is not None else colors[obj["color"]]
        x0, y0, x1, y1 = (v * side for v in obj["bbox"])
        if obj["shape"] == "circle":
            draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
        elif obj["shape"] == "square":
            draw.rectangle([round(x0), round(y0), round(x1) - 1, round(y1) - 1], fill=fill)
        elif obj["shape"] == "triangle":
            draw.polygon([(x0, y1 - 1), (x1 - 1, y1 - 1), ((x0 + x1 - 1) / 2, y0)], fill=fill)
        else:
            raise ValueError(f"unknown shape {obj['shape']!r}; expected one of {SHAPES}")
    if factor > 1:
        canvas = canvas.resize((resolution, resolution), Image.Resampling.BOX)
    return canvas


def _object_phrase(obj: dict, rng: random.Random, with_size: bool, with_color: bool = True) -> str:
    words = [rng.choice(SIZE_WORDS[obj["size"]])] if with_size else []
    words += ([obj["color"]] if with_color else []) + [obj["shape"]]
    return f"{article(words[0])} {' '.join(words)}"


def make_caption(
    truth: dict, rng: random.Random, background_phrase_prob: float = 0.5, name_colors: bool = True
) -> str:
    """A caption for ``truth`` with randomly varied phrasing (templates, size synonyms, background).
    ``name_colors=False`` leaves the object colors out ("a small circle on the left"), for
    :func:`color_free_view`; the random draws are the same either way."""
    bg = f" on a {truth['background']} background" if rng.random() < background_phrase_prob else ""
    objs = truth["objects"]
    if truth["relation"] is None:
        obj = _object_phrase(objs[0], rng, with_size=True, with_color=name_colors)
        return rng.choice(_SINGLE_TEMPLATES).format(
            obj=obj, pos=POSITION_PHRASES[objs[0]["position"]], bg=bg
        )
    a, b = (_object_phrase(o, rng, with_size=False, with_color=name_colors) for o in objs)
    return rng.choice(_PAIR_TEMPLATES).format(a=a, rel=truth["relation"], b=b, bg=bg)


#: An unnamed object color (:func:`unnamed_color`) is at least this far (Euclidean, sRGB 0-255) from
#: every named color and every background, so a color-free view never shows, say, a reddish
#: triangle.
UNNAMED_COLOR_MIN_DISTANCE = 90.0


def unnamed_color(rng: random.Random) -> tuple[int, int, int]:
    """A random sRGB color that is none of the world's named colors nor a background color (at least
    :data:`UNNAMED_COLOR_MIN_DISTANCE` from each): pinks, cyans, browns, olives, navies, ..."""
    refs = (*COLORS.values(), *BACKGROUNDS.values())
    for _ in range(10_000):
        c = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        if all(math.dist(c, r) >= UNNAMED_COLOR_MIN_DISTANCE for r in refs):
            return c
    raise AssertionError("drawing an unnamed color did not terminate")


def color_free_view(
    truth: dict, rng: random.Random, resolution: int = 64, background_phrase_prob: float = 0.5
) -> tuple[Image.Image, str]:
    """The scene ``truth`` with its objects painted in unnamed colors (:func:`unnamed_color`, one
    per object) and a caption that names no color: ``(image, caption)``.

    A training augmentation: a model that must match "a small triangle on the left" to triangles of
    arbitrary colors learns shape features that do not depend on color, which is what reading the
    held-out color–shape pairs needs. It never shows a held-out combination: the colors are unnamed
    and every other attribute is ``truth``'s (draw ``truth`` from the ``"train"`` split).
    """
    fills = [unnamed_color(rng) for _ in truth["objects"]]
    caption = make_caption(truth, rng, background_phrase_prob, name_colors=False)
    return render(truth, resolution, fills), caption


class ShapesWorld:
    """The shapes dataset as an indexable, effectively infinite sequence.

    ``world[i]`` -> :class:`ShapesSample`, a pure function of ``(seed, split, index, resolution)``
    (the per-index RNG is ``random.Random(f"{seed}:{split}:{index}")``; no global state).
    ``extra_colors``: named colors beyond the spec's (module doc); default: the spec's world.
    """

    def __init__(
        self,
        resolution: int = 64,
        seed: int = 0,
        split: str = "train",
        two_object_prob: float = 0.3,
        background_phrase_prob: float = 0.5,
        extra_colors=None,
    ):
        self.extra_colors = check_extra_colors(extra_colors) or None
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
        if not isinstance(resolution, int) or not 8 <= resolution <= 4096:
            raise ValueError(f"resolution must be an int in [8, 4096], got {resolution!r}")
        for name, p in (
            ("two_object_prob", two_object_prob),
            ("background_phrase_prob", background_phrase_prob),
        ):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        self.resolution, self.seed, self.split = resolution, int(seed), split
        self.two_object_prob, self.background_phrase_prob = two_object_prob, background_phrase_prob

    def rng(self, index: int) -> random.Random:
        return random.Random(f"{self.seed}:{self.split}:{index}")

    def truth(self, index: int) -> dict:
        """The ground truth of sample ``index`` without rendering it."""
        return sample_truth(
            self.rng(self._check(index)), self.split, self.two_object_prob, self.extra_colors
        )

    def _check(self, index) -> int:
        try:
            value = operator.index(index) if not isinstance(index, bool) else -1
        except TypeError:
            value = -1
        if value < 0:
            raise IndexError(f"ShapesWorld index must be a non-negative int, got {index!r}")
        return value

    def __getitem__(self, index: int) -> ShapesSample:
        rng = self.rng(self._check(index))
        truth = sample_truth(rng, self.split, self.two_object_prob, self.extra_colors)
        caption = make_caption(truth, rng, self.background_phrase_prob)
        image = render(truth, self.resolution, extra_colors=self.extra_colors)
        return ShapesSample(image, caption, truth)

    def __repr__(self) -> str:
        return (
            f"ShapesWorld(resolution={self.resolution}, seed={self.seed}, split={self.split!r}, "
            f"two_object_prob={self.two_object_prob}, "
            f"background_phrase_prob={self.background_phrase_prob}"
            + (f", extra_colors={self.extra_colors}" if self.extra_colors else "")
            + ")"
        )


def caption_vocabulary() -> list[str]:
    """Every word (and punctuation mark) a caption of this world can contain: the templates' words,
    the position phrases, relations, size words, color, shape and background names, and the
    articles. For a closed-vocabulary CLIP file (:func:`unclip.nets.clip.closed_vocabulary_ids`)."""
    text = " ".join(
        [
            *_SINGLE_TEMPLATES,
            *_PAIR_TEMPLATES,
            *POSITION_PHRASES.values(),
            *RELATIONS,
            *(w for words in SIZE_WORDS.values() for w in words),
            *COLORS,
            *SHAPES,
            *BACKGROUNDS,
            "a an on background",
        ]
    )
    text = re.sub(r"\{\w+\}", " ", text)
    return sorted(set(re.findall(r"[a-z]+|,", text)))


# names that moved out of this module keep their old import path, with a one-time FutureWarning
__getattr__ = package_getattr(__name__)
