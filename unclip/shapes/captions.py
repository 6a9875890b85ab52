"""Reading shapes captions: :func:`parse_caption` turns a caption back into the attributes it names
(the inverse of :func:`unclip.shapes.world.make_caption`), and :func:`canonical_caption` writes a
parsed caption in one fixed phrasing, so that captions that say the same thing compare equal.
"""

from __future__ import annotations

import functools
import re

from unclip.shapes.world import (
    BACKGROUNDS,
    COLORS,
    POSITION_PHRASES,
    RELATIONS,
    SHAPES,
    SIZE_WORDS,
    article,
    palette,
)

_SIZE_OF_WORD = {w: s for s, words in SIZE_WORDS.items() for w in words}


_POSITION_OF_PHRASE = {p: k for k, p in POSITION_PHRASES.items()}


def _alt(words) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_PREFIX = r"(?:(?:there\s+is|an\s+image\s+of)\s+)?"


_BG = r"(?:\s+on\s+an?\s+(?P<bg>" + _alt(BACKGROUNDS) + r")\s+background)?"


_POS = "(?P<pos{i}>" + _alt(_POSITION_OF_PHRASE) + ")"


@functools.lru_cache(maxsize=16)
def _caption_patterns(color_names: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """The single-object and two-object caption patterns for these color names."""
    obj = (
        r"an?\s+(?:(?P<size{i}>"
        + _alt(_SIZE_OF_WORD)
        + r")\s+)?(?P<color{i}>"
        + _alt(color_names)
        + r")\s+(?P<shape{i}>"
        + _alt(SHAPES)
        + ")"
    )
    single = re.compile(
        "^"
        + _PREFIX
        + "(?:"
        + _POS.format(i=1)
        + r",?\s+)?"
        + obj.format(i=0)
        + r"(?:\s+"
        + _POS.format(i=2)
        + ")?"
        + _BG
        + "$"
    )
    pair = re.compile(
        "^"
        + _PREFIX
        + obj.format(i=0)
        + r"\s+(?P<rel>"
        + _alt(RELATIONS)
        + r")\s+"
        + obj.format(i=1)
        + _BG
        + "$"
    )
    return single, pair


_SINGLE_RE, _PAIR_RE = _caption_patterns(tuple(COLORS))


def parse_caption(text: str, extra_colors=None) -> dict:
    """Parse a shapes caption into the attributes it names (the inverse of :func:`make_caption`).

    Returns ``{"background": name | None, "relation": None | relation, "objects": [{"shape",
    "color", "size", "position"}]}``; attributes the caption does not name are ``None``. Raises
    ``ValueError`` for text that is not a shapes caption. ``extra_colors``: color names beyond the
    spec's that the caption may use (module doc).
    """
    if not isinstance(text, str):
        raise TypeError(f"caption must be a str, got {type(text).__name__}")
    colors = palette(extra_colors) if extra_colors else COLORS
    single_re, pair_re = (
        _caption_patterns(tuple(colors)) if extra_colors else (_SINGLE_RE, _PAIR_RE)
    )
    norm = re.sub(r"\s+", " ", text.strip().lower()).rstrip(".").strip()
    m = pair_re.match(norm)
    if m:
        objs = [
            {
                "shape": m[f"shape{i}"],
                "color": m[f"color{i}"],
                "size": _SIZE_OF_WORD.get(m[f"size{i}"]) if m[f"size{i}"] else None,
                "position": None,
            }
            for i in (0, 1)
        ]
        return {"background": m["bg"], "relation": m["rel"], "objects": objs}
    m = single_re.match(norm)
    if m and not (m["pos1"] and m["pos2"]):
        pos = m["pos1"] or m["pos2"]
        obj = {
            "shape": m["shape0"],
            "color": m["color0"],
            "size": _SIZE_OF_WORD[m["size0"]] if m["size0"] else None,
            "position": _POSITION_OF_PHRASE[pos] if pos else None,
        }
        return {"background": m["bg"], "relation": None, "objects": [obj]}
    raise ValueError(
        f"not a shapes caption: {text!r}. Expected e.g. 'a small red circle on the left "
        f"[on a black background]' or 'a red circle to the left of a blue square'; colors "
        f"{sorted(colors)}, shapes {list(SHAPES)}, relations {list(RELATIONS)}"
    )


def canonical_caption(parsed: dict) -> str:
    """The caption of a :func:`parse_caption` result in one fixed phrasing (the first template,
    canonical size words), naming exactly the attributes it names: ``"a small red circle on the
    left on a black background"``, ``"a red circle to the left of a blue square"``."""

    def phrase(obj: dict) -> str:
        words = ([obj["size"]] if obj.get("size") else []) + [obj["color"], obj["shape"]]
        return f"{article(words[0])} {' '.join(words)}"

    bg = f" on a {parsed['background']} background" if parsed.get("background") else ""
    objs = parsed["objects"]
    if parsed["relation"] is None:
        pos = objs[0].get("position")
        return f"{phrase(objs[0])}{' ' + POSITION_PHRASES[pos] if pos else ''}{bg}"
    return f"{phrase(objs[0])} {parsed['relation']} {phrase(objs[1])}{bg}"
