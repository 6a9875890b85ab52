"""The shapes dataset: determinism, ground truth vs pixels, splits, captions, geometry, writers,
CLI."""

import io
import json
import math
import re

import numpy as np
import pytest
import webdataset
from PIL import Image

from unclip.cli import make_shapes
from unclip.shapes import world as shapes
from unclip.shapes.captions import canonical_caption, parse_caption
from unclip.shapes.contrasts import caption_alternatives
from unclip.shapes.export import write_shapes
from unclip.shapes.world import (
    BACKGROUNDS,
    COLORS,
    HELDOUT_COMBINATIONS,
    POSITIONS,
    RELATIONS,
    SHAPES,
    SIZES,
    ShapesWorld,
    is_heldout,
    make_caption,
    render,
)


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def color_close(pixel, rgb, tol=12) -> bool:
    return max(abs(int(a) - int(b)) for a, b in zip(pixel, rgb)) <= tol


@pytest.fixture(scope="module")
def mixed_samples():
    world = ShapesWorld(resolution=64, seed=7, split="all", two_object_prob=0.5)
    return [world[i] for i in range(150)]


def test_same_args_give_identical_png_bytes_and_other_indices_differ():
    a = ShapesWorld(resolution=64, seed=3)
    b = ShapesWorld(resolution=64, seed=3)
    for i in (0, 1, 17):
        sa, sb = a[i], b[i]
        assert png_bytes(sa.image) == png_bytes(sb.image)
        assert sa.caption == sb.caption and sa.truth == sb.truth
    pngs = {png_bytes(a[i].image) for i in range(20)}
    assert len(pngs) == 20, "different indices must give different images"
    assert png_bytes(ShapesWorld(resolution=64, seed=4)[0].image) != png_bytes(a[0].image)
    # The scene depends on (seed, split, index) only; the resolution only changes the rendering.
    big = ShapesWorld(resolution=96, seed=3)[1]
    assert big.truth == a[1].truth and big.caption == a[1].caption and big.image.size == (96, 96)


def test_sample_types_and_truth_is_json_serialisable(mixed_samples):
    s = mixed_samples[0]
    assert isinstance(s.image, Image.Image) and s.image.mode == "RGB" and s.image.size == (64, 64)
    for s in mixed_samples[:30]:
        assert json.loads(json.dumps(s.truth)) == s.truth
        assert set(s.truth) == {"background", "relation", "objects"}
        for obj in s.truth["objects"]:
            assert set(obj) == {"shape", "color", "size", "position", "center", "bbox", "extent"}


def test_ground_truth_agrees_with_pixels(mixed_samples):
    for s in mixed_samples:
        px = np.asarray(s.image)
        truth = s.truth
        for obj in truth["objects"]:
            cx, cy = obj["center"]
            assert color_close(px[int(cy * 64), int(cx * 64)], COLORS[obj["color"]]), (truth, obj)
            x0, y0, x1, y1 = obj["bbox"]
            assert 0.0 <= x0 < x1 <= 1.0 and 0.0 <= y0 < y1 <= 1.0
            assert math.isclose(x1 - x0, obj["extent"], abs_tol=1e-5)
            lo, hi = SIZES[obj["size"]]
            assert lo <= obj["extent"] <= hi
            if obj["position"] is not None:
                px_, py_ = POSITIONS[obj["position"]]
                assert abs(cx - px_) <= 0.04 + 1e-6 and abs(cy - py_) <= 0.04 + 1e-6
                nearest = min(POSITIONS, key=lambda k: math.dist(POSITIONS[k], (cx, cy)))
                assert nearest == obj["position"]
        # corners outside every (dilated) bbox show the background color
        corners = [(0, 0), (0, 63), (63, 0), (63, 63)]
        free = [
            (r, c)
            for r, c in corners
            if not any(
                o["bbox"][0] * 64 - 2 <= c <= o["bbox"][2] * 64 + 2
                and o["bbox"][1] * 64 - 2 <= r <= o["bbox"][3] * 64 + 2
                for o in truth["objects"]
            )
        ]
        assert free, truth
        for r, c in free:
            assert tuple(px[r, c]) == BACKGROUNDS[truth["background"]]


def test_rendered_area_matches_shape():
    """Pixels of the object's color cover the area of a circle / square / equilateral triangle."""
    expected_fill = {
        "circle": math.pi / 4,
        "square": 1.0,
        "triangle": math.sqrt(3) / 4,
    }  # area / extent^2
    for shape in SHAPES:
        truth = {
            "background": "white",
            "relation": None,
            "objects": [shapes._object(shape, "blue", "large", "center", 0.5, 0.5, 0.5)],
        }
        img = np.asarray(render(truth, 128)).astype(int)
        blue = np.abs(img - np.array(COLORS["blue"])).max(-1) < 60
        assert blue.sum() / (0.5 * 128) ** 2 == pytest.approx(expected_fill[shape], rel=0.06), shape
        rows = np.nonzero(blue.any(1))[0]
        widths = blue.sum(1)[rows]
        if shape == "triangle":  # apex up: narrow rows at the top, wide at the bottom
            assert widths[0] < widths[-1] / 4
        elif shape == "square":
            assert widths.min() >= 0.95 * widths.max()
        else:  # circle: narrow at top and bottom, widest in the middle
            assert (
                widths[0] < widths[len(widths) // 2] / 2
                and widths[-1] < widths[len(widths) // 2] / 2
            )


@pytest.mark.parametrize("resolution", [16, 33, 256])
def test_render_any_resolution(resolution):
    s = ShapesWorld(resolution=resolution, seed=1)[2]
    assert s.image.size == (resolution, resolution)
    with pytest.raises(ValueError, match="resolution"):
        render(s.truth, 4)


def test_train_split_never_contains_heldout_and_heldout_always_does():
    train = ShapesWorld(seed=0, split="train", two_object_prob=0.5)
    held = ShapesWorld(seed=0, split="heldout", two_object_prob=0.5)
    for i in range(500):
        truth = train.truth(i)
        for obj in truth["objects"]:
            for combo in HELDOUT_COMBINATIONS:
                assert not all(obj[k] == v for k, v in combo.items()), (i, truth)
    held_truths = [held.truth(i) for i in range(200)]
    assert all(is_heldout(t) for t in held_truths)
    assert {len(t["objects"]) for t in held_truths} == {1, 2}
    # every combination is used for evaluation, and "all" mixes both kinds
    for combo in HELDOUT_COMBINATIONS:
        assert any(
            shapes.matches_combination(o, combo) for t in held_truths for o in t["objects"]
        ), combo
    everything = [ShapesWorld(split="all").truth(i) for i in range(300)]
    assert 0 < sum(map(is_heldout, everything)) < 300
    # each attribute value still appears in training, only the combinations are missing
    train_objs = [o for i in range(300) for o in train.truth(i)["objects"]]
    for key, values in (("color", COLORS), ("shape", SHAPES), ("position", POSITIONS)):
        assert {o[key] for o in train_objs} >= set(values)


def test_heldout_is_also_detected_from_a_parsed_caption():
    assert is_heldout(parse_caption("a red triangle to the left of a green circle"))
    assert is_heldout(parse_caption("a big green square at the bottom"))
    assert not is_heldout(parse_caption("a small red circle on the left"))


def test_caption_phrasing_varies_and_round_trips():
    world = ShapesWorld(seed=5, split="all", two_object_prob=0.4)
    captions = []
    for i in range(300):
        s = world[i]
        captions.append(s.caption)
        parsed = parse_caption(s.caption)
        assert parsed["relation"] == s.truth["relation"]
        named_bg = f"on a {s.truth['background']} background" in s.caption
        assert parsed["background"] == (s.truth["background"] if named_bg else None)
        assert len(parsed["objects"]) == len(s.truth["objects"])
        for p, t in zip(parsed["objects"], s.truth["objects"]):
            assert (p["shape"], p["color"], p["position"]) == (
                t["shape"],
                t["color"],
                t["position"],
            )
            assert p["size"] == (
                t["size"] if s.truth["relation"] is None else None
            )  # pairs name no size
    words = set(" ".join(captions).replace(",", "").split())
    assert {"small", "tiny", "little", "large", "big"} <= words
    assert sum("background" in c for c in captions) not in (0, len(captions))
    assert (
        len(
            {
                re.sub(
                    r"(red|green|blue|yellow|purple|orange|circle|square|triangle|small|tiny|little|"
                    r"large|big|an?\b)",
                    "",
                    c,
                )
                for c in captions
            }
        )
        >= 20
    )
    for rel in RELATIONS:
        assert any(f" {rel} " in c for c in captions), rel
    assert len(set(captions)) > 250


def test_english_articles():
    world = ShapesWorld(seed=2, split="all", two_object_prob=0.5)
    captions = [world[i].caption for i in range(200)]
    for c in captions:
        for art, word in re.findall(r"\b(an?) (\w+)", c):
            assert art == ("an" if word[0] in "aeiou" else "a"), c
    assert any("an orange" in c for c in captions)
    truth = {
        "background": "gray",
        "relation": None,
        "objects": [shapes._object("square", "orange", "large", "left", 0.3, 0.5, 0.5)],
    }
    rng = shapes.random.Random(0)
    caption = make_caption(truth, rng, background_phrase_prob=0.0)
    assert re.search(r"\ba (large|big) orange square\b", caption), caption
    pair = {
        "background": "gray",
        "relation": "above",
        "objects": [
            shapes._object("square", "orange", "small", None, 0.5, 0.2, 0.25),
            shapes._object("circle", "red", "small", None, 0.5, 0.7, 0.25),
        ],
    }
    caption = make_caption(pair, rng, background_phrase_prob=0.0)
    assert re.search(r"\ban orange square above a red circle$", caption), caption


def test_parse_caption_examples_and_errors():
    assert parse_caption("A big blue square in the center on a black background.") == {
        "background": "black",
        "relation": None,
        "objects": [{"shape": "square", "color": "blue", "size": "large", "position": "center"}],
    }
    assert parse_caption("a red circle to the left of a green triangle on a gray background") == {
        "background": "gray",
        "relation": "to the left of",
        "objects": [
            {"shape": "circle", "color": "red", "size": None, "position": None},
            {"shape": "triangle", "color": "green", "size": None, "position": None},
        ],
    }
    for bad in [
        "a cat sitting on a mat",
        "",
        "a red circle on the left at the top",
        "a red hexagon on the left",
        "a red circle next to a blue square",
    ]:
        with pytest.raises(ValueError, match="not a shapes caption"):
            parse_caption(bad)
    with pytest.raises(TypeError):
        parse_caption(None)


def _attribute_diff(a: dict, b: dict) -> list[str]:
    """The attributes two parsed captions name differently (object i's as key{i})."""
    out = [k for k in ("background", "relation") if a[k] != b[k]]
    for i, (x, y) in enumerate(zip(a["objects"], b["objects"])):
        out += [f"{k}{i}" for k in x if x[k] != y[k]]
    return out


@pytest.mark.parametrize(
    "caption,count",
    [
        # 5 other colors, 2 shapes, 1 size, 4 positions, 2 backgrounds
        ("there is a tiny green triangle on the left on a gray background", 14),
        ("a yellow square", 7),  # 5 colors, 2 shapes: it names nothing else
        # per object 4 colors (not the other's) and 2 shapes; 3 relations; 2 swaps
        ("an image of a red circle to the left of a blue square", 17),
        ("a red circle above a blue circle", 16),  # same shapes: no shape swap
    ],
)
def test_caption_alternatives_change_one_attribute_or_swap_the_pair(caption, count):
    first, *others = caption_alternatives(caption)
    parsed = parse_caption(caption)
    assert parse_caption(first) == parsed and first == canonical_caption(parsed)
    assert len(others) == count and len(set(others)) == count and first not in others
    swaps = 0
    for alt in others:
        q = parse_caption(alt)  # every alternative is a caption of the world
        changed = _attribute_diff(parsed, q)
        if parsed["relation"] is not None:
            assert q["objects"][0]["color"] != q["objects"][1]["color"]
        if changed in (["color0", "color1"], ["shape0", "shape1"]):  # the pair swapped
            a, b = parsed["objects"]
            key = changed[0][:-1]
            assert (q["objects"][0][key], q["objects"][1][key]) == (b[key], a[key])
            swaps += 1
        else:
            assert len(changed) == 1, (alt, changed)
    pair = parsed["relation"] is not None
    assert swaps == (pair and len({o["shape"] for o in parsed["objects"]}) == 2) + pair
    assert canonical_caption(parse_caption("a big blue square in the center")) == (
        "a large blue square in the center"
    )
    with pytest.raises(ValueError, match="not a shapes caption"):
        caption_alternatives("a cat on a mat")


def test_shapes_contrast_reads_extra_colors_and_warns_on_other_prompts():
    from unclip.sampling.scorers import RERANK_CONTRASTS
    from unclip.shapes.contrasts import shapes_contrast

    pink = shapes_contrast({"pink": (255, 105, 180)})
    assert "a pink square" in pink("a yellow square")
    assert pink("a pink circle to the left of a blue square")[0] == (
        "a pink circle to the left of a blue square"
    )
    with pytest.warns(UserWarning, match="'a cat' is not a shapes caption"):
        assert shapes_contrast()("a cat") == []
    # "shapes-pairs": single objects are left to the plain cosine, pairs contrasted as "shapes"
    pairs = RERANK_CONTRASTS["shapes-pairs"]
    assert (
        pairs("a yellow square") == [] and len(RERANK_CONTRASTS["shapes"]("a yellow square")) == 8
    )
    pair = "a red circle above a blue square"
    assert pairs(pair) == RERANK_CONTRASTS["shapes"](pair) == caption_alternatives(pair)


def test_region_parts_put_each_object_on_its_side_against_its_other_colors_and_shapes():
    """``shapes-pairs-regions``: a two-object caption's objects as region parts, ordered along the
    relation's axis (the first object of "A to the right of B" on the high side), each a
    single-object caption with the prompt's background against every other color (extra colors
    too) and shape of that object; a single object has none."""
    from unclip.sampling.scorers import RERANK_CONTRASTS
    from unclip.shapes.contrasts import region_parts, shapes_contrast

    regions = RERANK_CONTRASTS["shapes-pairs-regions"]
    pair = "a red circle to the right of a blue square on a gray background"
    assert regions(pair) == RERANK_CONTRASTS["shapes-pairs"](pair)
    assert regions.regions("a yellow square") == [] and regions("a yellow square") == []
    low, high = regions.regions(pair)
    assert (low.axis, low.low, high.axis, high.low) == ("x", True, "x", False)
    assert low.captions[0] == "a small blue square on the left on a gray background"
    assert high.captions[0] == "a small red circle on the right on a gray background"
    assert len(low.captions) == len(set(low.captions)) == 1 + 5 + 2
    assert "a small red square on the left on a gray background" in low.captions
    assert "a small blue triangle on the left on a gray background" in low.captions
    above = region_parts("a green triangle above an orange circle")
    assert [(p.axis, p.low, p.captions[0]) for p in above] == [
        ("y", True, "a small green triangle at the top"),
        ("y", False, "a small orange circle at the bottom"),
    ]
    assert region_parts("a green triangle below an orange circle")[0].captions[0] == (
        "a small orange circle at the top"
    )
    pink = shapes_contrast({"pink": (255, 105, 180)}, pairs_only=True, regions=True)
    assert (
        "a small pink circle at the top"
        in pink.regions("a red circle above a blue square")[0].captions
    )
    assert not hasattr(RERANK_CONTRASTS["shapes-pairs"], "regions")
    with pytest.raises(ValueError, match="not a shapes caption"):
        region_parts("a cat to the left of a dog")


def test_two_object_geometry():
    world = ShapesWorld(seed=11, split="all", two_object_prob=1.0)
    for i in range(200):
        t = world.truth(i)
        a, b = t["objects"]
        assert a["color"] != b["color"] and a["size"] == b["size"] == "small"
        assert a["position"] is None and b["position"] is None
        dx = a["center"][0] - b["center"][0]
        dy = a["center"][1] - b["center"][1]
        along, across = {
            "to the left of": (-dx, dy),
            "to the right of": (dx, dy),
            "above": (-dy, dx),
            "below": (dy, dx),
        }[t["relation"]]
        assert along >= 0.25 - 1e-6 and abs(across) <= 0.1 + 1e-6, t
        ax0, ay0, ax1, ay1 = a["bbox"]
        bx0, by0, bx1, by1 = b["bbox"]
        assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"overlap: {t}"
        for x0, y0, x1, y1 in (a["bbox"], b["bbox"]):
            assert 0 <= x0 and x1 <= 1 and 0 <= y0 and y1 <= 1


def test_world_argument_errors():
    with pytest.raises(ValueError, match="split"):
        ShapesWorld(split="test")
    with pytest.raises(ValueError, match="two_object_prob"):
        ShapesWorld(two_object_prob=1.5)
    for bad in (-1, 1.5, "3"):
        with pytest.raises(IndexError):
            ShapesWorld()[bad]
    assert ShapesWorld()[np.int64(3)].truth == ShapesWorld()[3].truth


def test_folder_output(tmp_path):
    paths = write_shapes(tmp_path, 4, resolution=32, seed=9, start_index=10, progress=False)
    world = ShapesWorld(resolution=32, seed=9)
    assert [p.name for p in paths] == [f"{i:08d}.png" for i in range(10, 14)]
    for i in range(10, 14):
        s = world[i]
        assert (tmp_path / f"{i:08d}.png").read_bytes() == png_bytes(s.image)
        assert (tmp_path / f"{i:08d}.txt").read_text() == s.caption
        assert json.loads((tmp_path / f"{i:08d}.json").read_text()) == s.truth
    assert not list(tmp_path.glob("*.tmp"))


def test_webdataset_shards_read_back_with_webdataset(tmp_path):
    paths = write_shapes(
        tmp_path,
        7,
        resolution=32,
        seed=4,
        split="heldout",
        format="webdataset",
        shard_size=3,
        progress=False,
    )
    assert [p.name for p in paths] == ["00000.tar", "00001.tar", "00002.tar"]
    stats = json.loads((tmp_path / "00002_stats.json").read_text())
    assert stats["count"] == stats["successes"] == 1
    assert not list(tmp_path.glob("*.tmp"))
    world = ShapesWorld(resolution=32, seed=4, split="heldout")
    urls = [str(p) for p in paths]
    samples = list(webdataset.WebDataset(urls, shardshuffle=False).decode("pil"))
    assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(7)]
    for i, sample in enumerate(samples):
        ref = world[i]
        assert sample["txt"] == ref.caption
        assert sample["json"]["caption"] == ref.caption and sample["json"]["key"] == f"{i:08d}"
        assert sample["json"]["truth"] == ref.truth
        assert np.array_equal(np.asarray(sample["png"].convert("RGB")), np.asarray(ref.image))


def test_webdataset_jpg_and_start_index(tmp_path):
    paths = write_shapes(
        tmp_path,
        2,
        resolution=32,
        format="webdataset",
        shard_size=2,
        start_index=4,
        image_format="jpg",
        progress=False,
    )
    assert [p.name for p in paths] == ["00002.tar"]
    raw = next(iter(webdataset.WebDataset([str(paths[0])], shardshuffle=False)))
    assert raw["jpg"][:3] == b"\xff\xd8\xff", "the .jpg entry must hold JPEG data"
    (sample,) = list(webdataset.WebDataset([str(paths[0])], shardshuffle=False).decode("pil"))[:1]
    ref = ShapesWorld(resolution=32)[4]
    diff = np.abs(
        np.asarray(sample["jpg"].convert("RGB")).astype(int) - np.asarray(ref.image).astype(int)
    )
    assert diff.mean() < 6
    with pytest.raises(ValueError, match="multiple of shard_size"):
        write_shapes(tmp_path, 2, format="webdataset", shard_size=3, start_index=4, progress=False)


def test_write_shapes_argument_errors(tmp_path):
    for kwargs, msg in [
        (dict(num_samples=0), "num_samples"),
        (dict(num_samples=1, format="zip"), "format"),
        (dict(num_samples=1, image_format="gif"), "image_format"),
        (dict(num_samples=1, split="dev"), "split"),
    ]:
        with pytest.raises(ValueError, match=msg):
            write_shapes(tmp_path, progress=False, **kwargs)


def test_cli_writes_dataset(tmp_path, capsys):
    out = tmp_path / "wds"
    assert (
        make_shapes.main(
            [
                str(out),
                "--num",
                "3",
                "--resolution",
                "16",
                "--seed",
                "2",
                "--split",
                "all",
                "--format",
                "webdataset",
                "--shard-size",
                "2",
                "--image-format",
                "png",
                "--no-progress",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in out.glob("*.tar")) == ["00000.tar", "00001.tar"]
    assert "wrote 3 samples" in capsys.readouterr().out
    make_shapes.main([str(tmp_path / "f"), "--num", "2", "--resolution", "16", "--no-progress"])
    assert len(list((tmp_path / "f").glob("*.png"))) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num", "0"], "--num: must be >= 1"),
        (["--num", "x"], "expected an integer"),
        (["--num", "2", "--split", "test"], "invalid choice: 'test'"),
        (["--num", "2", "--format", "zip"], "invalid choice: 'zip'"),
        (["--num", "2", "--resolution", "5000"], "--resolution must be in"),
        (["--num", "2", "--two-object-prob", "2"], "--two-object-prob must be in"),
        (
            ["--num", "2", "--format", "webdataset", "--shard-size", "3", "--start-index", "1"],
            "multiple of",
        ),
        ([], "--num"),
    ],
)
def test_cli_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        make_shapes.main([str(tmp_path / "out")] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _attributes(truth: dict) -> dict:
    """The named attributes of a scene (not its exact geometry)."""
    out = {"background": truth["background"], "relation": truth["relation"]}
    for i, o in enumerate(truth["objects"]):
        out.update({f"{k}{i}": o[k] for k in ("shape", "color", "size", "position")})
    return out


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_contrast_truth_changes_exactly_the_named_attribute_and_stays_in_split(split):
    world = ShapesWorld(resolution=32, seed=3, split=split, two_object_prob=0.5)
    import random

    seen = set()
    for i in range(300):
        truth = world.truth(i)
        new, attr = shapes.contrast_truth(truth, random.Random(i), split)
        seen.add((truth["relation"] is not None, attr))
        before, after = _attributes(truth), _attributes(new)
        changed = {k.rstrip("01") for k in before if before[k] != after[k]}
        assert changed == {attr}, (truth, new, attr)
        assert sum(before[k] != after[k] for k in before) == 1
        assert is_heldout(new) == (split == "heldout")
        if new["relation"] is not None:
            assert new["objects"][0]["color"] != new["objects"][1]["color"]
            # the new relation is where the objects are: first minus second along the relation's
            # axis
            (ax, ay), (bx, by) = (o["center"] for o in new["objects"])
            d = {
                "to the left of": bx - ax,
                "to the right of": ax - bx,
                "above": by - ay,
                "below": ay - by,
            }
            assert d[new["relation"]] >= shapes.MIN_SEPARATION - 1e-6
    assert {a for p, a in seen if p} == {"relation", "shape", "color"}
    assert {a for p, a in seen if not p} == {"shape", "position", "size", "color"}


def test_contrast_truth_errors_and_background():
    import random

    truth = ShapesWorld(32, seed=0, split="train", two_object_prob=0.0).truth(0)
    new, attr = shapes.contrast_truth(truth, random.Random(0), weights={"background": 1.0})
    assert attr == "background" and new["background"] != truth["background"]
    assert new["objects"] == truth["objects"]
    with pytest.raises(ValueError, match="relation"):  # a single-object scene has no relation
        shapes.contrast_truth(truth, random.Random(0), weights={"relation": 1.0})
    with pytest.raises(ValueError, match="unknown split"):
        shapes.contrast_truth(truth, random.Random(0), split="test")
    with pytest.raises(ValueError, match="attributes among"):  # one object: nothing to swap
        shapes.contrast_truth(truth, random.Random(0), weights={"swap": 1.0})


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_contrast_truth_swap_exchanges_the_two_colors_in_place_and_stays_in_split(split):
    import random

    world = ShapesWorld(resolution=32, seed=5, split=split, two_object_prob=1.0)
    swapped = 0
    for i in range(60):
        truth = world.truth(i)
        try:
            new, attr = shapes.contrast_truth(truth, random.Random(i), split, {"swap": 1.0})
        except ValueError:
            # both swapped objects would leave the split (e.g. a held-out pair whose swap
            # shows no held-out combination); any other scene must swap
            a, b = truth["objects"]
            flipped = [{**a, "color": b["color"]}, {**b, "color": a["color"]}]
            assert is_heldout({"objects": flipped}) != (split == "heldout")
            continue
        swapped += 1
        assert attr == "swap" and is_heldout(new) == (split == "heldout")
        a, b = truth["objects"]
        na, nb = new["objects"]
        assert (na["color"], nb["color"]) == (b["color"], a["color"])
        # everything else (shapes, sizes, exact boxes, relation, background) is kept
        for old, nw in ((a, na), (b, nb)):
            assert {k: v for k, v in nw.items() if k != "color"} == {
                k: v for k, v in old.items() if k != "color"
            }
        assert (new["relation"], new["background"]) == (truth["relation"], truth["background"])
        assert canonical_caption(new) != canonical_caption(truth)
    assert swapped >= (30 if split == "train" else 10)  # held-out pairs rarely stay held out


def test_color_free_view_repaints_the_same_scene_in_unnamed_colors_and_drops_color_words():
    import random

    from unclip.shapes.world import UNNAMED_COLOR_MIN_DISTANCE, color_free_view

    world = ShapesWorld(resolution=64, seed=3, split="train", two_object_prob=0.5)
    refs = list(COLORS.values()) + list(BACKGROUNDS.values())
    kinds = set()
    for i in range(60):
        s = world[i]
        image, caption = color_free_view(s.truth, random.Random(i), 64, background_phrase_prob=0.5)
        words = caption.split()
        assert not set(words) & set(COLORS), caption
        assert [w for w in words if w in SHAPES] == [o["shape"] for o in s.truth["objects"]], (
            caption
        )
        if s.truth["relation"] is not None:
            assert s.truth["relation"] in caption
        else:
            assert shapes.POSITION_PHRASES[s.truth["objects"][0]["position"]] in caption
        px = np.asarray(image)
        for obj in s.truth[
            "objects"
        ]:  # same geometry, an unnamed object color at every object's centre
            cx, cy = obj["center"]
            fill = px[int(cy * 64), int(cx * 64)].astype(float)
            assert min(math.dist(fill, r) for r in refs) >= UNNAMED_COLOR_MIN_DISTANCE - 2, (
                caption,
                fill,
            )
        assert tuple(px[0, 0]) == BACKGROUNDS[s.truth["background"]] or len(s.truth["objects"]) == 2
        kinds.add(len(s.truth["objects"]))
        # reproducible from the rng
        again = color_free_view(s.truth, random.Random(i), 64, background_phrase_prob=0.5)
        assert again[1] == caption and png_bytes(again[0]) == png_bytes(image)
    assert kinds == {1, 2}
    with pytest.raises(ValueError, match="one RGB color per object"):
        render(world[0].truth, 32, fills=[])
