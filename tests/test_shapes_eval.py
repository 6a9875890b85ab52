"""The pixel evaluator of the shapes world: detection, scoring, aggregation, robustness."""

import copy

import numpy as np
import pytest
from PIL import Image

from unclip.shapes.captions import parse_caption
from unclip.shapes.detector import classify_shape, detect, evaluate_images, relation_between, score
from unclip.shapes.world import COLORS, ShapesWorld, _object, render


@pytest.fixture(scope="module")
def renders():
    world = ShapesWorld(resolution=64, seed=21, split="all", two_object_prob=0.5)
    return [world[i] for i in range(200)]


def single(
    shape="circle",
    color="red",
    size="large",
    position="left",
    background="white",
    cx=0.3,
    cy=0.5,
    extent=0.5,
):
    return {
        "background": background,
        "relation": None,
        "objects": [_object(shape, color, size, position, cx, cy, extent)],
    }


def test_evaluator_scores_ground_truth_renders_at_64px(renders):
    report = evaluate_images([s.image for s in renders], [s.caption for s in renders])
    assert report["count"] == 200
    assert report["single"]["count"] > 60 and report["pair"]["count"] > 60
    assert report["single"]["count"] + report["pair"]["count"] == 200
    for kind in ("single", "pair"):
        assert report[kind]["all"] >= 0.99, report
        assert report[kind]["background_count"] < report[kind]["count"]  # only captions naming one
    for key in ("color", "shape", "size", "position", "background"):
        assert report["single"][key] >= 0.99, (key, report)
    for key in ("colors", "shapes", "relation", "background"):
        assert report["pair"][key] >= 0.99, (key, report)
    assert report["all"] >= 0.99


def test_detect_recovers_ground_truth(renders):
    for s in renders[:60]:
        det = detect(s.image)
        assert det["background"] == s.truth["background"]
        assert len(det["objects"]) == len(s.truth["objects"]), (s.truth, det)
        for t in s.truth["objects"]:
            (d,) = [o for o in det["objects"] if o["color"] == t["color"]]
            assert d["shape"] == t["shape"] and d["size"] == t["size"]
            assert (
                abs(d["center"][0] - t["center"][0]) < 2 / 64
                and abs(d["center"][1] - t["center"][1]) < 2 / 64
            )
            assert abs(d["extent"] - t["extent"]) < 3 / 64
            if t["position"] is not None:
                assert d["position"] == t["position"]
        if s.truth["relation"] is not None:
            a, b = s.truth["objects"]
            da, db = ([o for o in det["objects"] if o["color"] == t["color"]][0] for t in (a, b))
            assert relation_between(da["center"], db["center"]) == s.truth["relation"]


def test_uniform_noise_scores_near_zero(renders):
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(60)]
    report = evaluate_images(noise, [s.caption for s in renders[:60]])
    assert report["all"] <= 0.02
    assert report["single"]["color"] <= 0.3 and report["pair"]["colors"] <= 0.1
    assert report["single"]["background"] <= 0.7  # chance is 1/3


def test_blank_image_has_no_objects():
    blank = Image.new("RGB", (64, 64), (15, 15, 15))
    det = detect(blank)
    assert det == {"background": "black", "relation": None, "objects": []}
    result = score(blank, parse_caption("a small red circle on the left on a black background"))
    assert result == {
        "color": False,
        "shape": False,
        "size": False,
        "position": False,
        "background": True,
        "objects": False,
        "all": False,
    }


@pytest.mark.parametrize(
    "field, wrong",
    [("color", "blue"), ("shape", "triangle"), ("size", "small"), ("position", "right")],
)
def test_single_object_score_flags_each_wrong_attribute(field, wrong):
    image = render(single(), 64)  # large red circle on the left, white background
    expected = {
        "background": "white",
        "relation": None,
        "objects": [{"shape": "circle", "color": "red", "size": "large", "position": "left"}],
    }
    assert score(image, expected) == {
        "color": True,
        "shape": True,
        "size": True,
        "position": True,
        "background": True,
        "objects": True,
        "all": True,
    }
    bad = copy.deepcopy(expected)
    bad["objects"][0][field] = wrong
    result = score(image, bad)
    assert result[field] is False and result["all"] is False
    assert all(v for k, v in result.items() if k not in (field, "all")), result
    bad_bg = dict(expected, background="gray")
    assert score(image, bad_bg)["background"] is False and score(image, bad_bg)["all"] is False
    no_bg = dict(expected, background=None)
    assert "background" not in score(image, no_bg)


def test_extra_object_fails_all_for_single_prompt():
    truth = single(extent=0.25, size="small", cx=0.3)
    truth["objects"].append(_object("square", "green", "small", None, 0.75, 0.5, 0.25))
    result = score(render(truth, 64), parse_caption("a small red circle on the left"))
    assert result["color"] and result["shape"] and result["position"] and not result["all"]
    assert result["objects"] is False


def test_two_object_score_checks_colors_shapes_and_relation():
    truth = {
        "background": "gray",
        "relation": "to the left of",
        "objects": [
            _object("circle", "red", "small", None, 0.25, 0.5, 0.25),
            _object("square", "blue", "small", None, 0.7, 0.45, 0.25),
        ],
    }
    image = render(truth, 64)
    ok = score(
        image, parse_caption("a red circle to the left of a blue square on a gray background")
    )
    assert ok == {
        "colors": True,
        "shapes": True,
        "relation": True,
        "background": True,
        "objects": True,
        "all": True,
    }
    assert score(image, parse_caption("a red circle to the right of a blue square")) == {
        "colors": True,
        "shapes": True,
        "relation": False,
        "objects": True,
        "all": False,
    }
    assert score(image, parse_caption("a blue square to the right of a red circle"))["all"] is True
    swapped = score(image, parse_caption("a red square to the left of a blue circle"))
    assert swapped == {
        "colors": True,
        "shapes": False,
        "relation": True,
        "objects": True,
        "all": False,
    }
    third = dict(
        truth,
        objects=truth["objects"] + [_object("triangle", "green", "small", None, 0.5, 0.15, 0.2)],
    )
    extra = score(
        render(third, 64),
        parse_caption("a red circle to the left of a blue square on a gray background"),
    )
    assert extra == {
        "colors": True,
        "shapes": True,
        "relation": True,
        "background": True,
        "objects": False,
        "all": False,
    }
    missing = score(image, parse_caption("a red circle to the left of a green square"))
    assert missing["colors"] is False and missing["relation"] is False and missing["all"] is False


def test_relation_and_shape_rules():
    assert relation_between([0.2, 0.5], [0.6, 0.55]) == "to the left of"
    assert relation_between([0.6, 0.5], [0.2, 0.45]) == "to the right of"
    assert relation_between([0.5, 0.2], [0.55, 0.7]) == "above"
    assert relation_between([0.5, 0.8], [0.45, 0.3]) == "below"
    assert classify_shape(0.98, 0.5) == "square"
    assert classify_shape(0.78, 0.5) == "circle"
    assert classify_shape(0.52, 0.74) == "triangle"


def test_array_input_other_resolutions_and_input_errors(renders):
    s = renders[3]
    assert detect(np.asarray(s.image)) == detect(s.image)
    for res in (128, 256):
        big = render(s.truth, res)
        assert score(big, parse_caption(s.caption))["all"], res
    with pytest.raises(TypeError, match="uint8"):
        detect(np.asarray(s.image).astype(np.float32))
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        detect(np.zeros((64, 64), dtype=np.uint8))


def test_robust_to_moderate_pixel_noise(renders):
    rng = np.random.default_rng(1)
    noisy = [
        np.clip(np.asarray(s.image).astype(float) + rng.normal(0, 20, (64, 64, 3)), 0, 255).astype(
            np.uint8
        )
        for s in renders[:80]
    ]
    report = evaluate_images(noisy, [s.caption for s in renders[:80]])
    assert report["all"] >= 0.95, report


def test_evaluate_images_errors(renders):
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        evaluate_images([renders[0].image, renders[1].image], [renders[0].caption])
    with pytest.raises(ValueError, match="caption 1: not a shapes caption"):
        evaluate_images([renders[0].image, renders[1].image], [renders[0].caption, "a dog"])


def test_palette_colors_are_distinguishable():
    """Each flat palette color alone is detected as that color (guards the reference table)."""
    for color in COLORS:
        image = render(single(color=color, background="gray"), 64)
        (obj,) = detect(image)["objects"]
        assert obj["color"] == color and obj["shape"] == "circle"


def test_shapes_eval_recipe_reports_every_stage_and_writes_report_and_grid(
    tiny_pipe, tmp_path, one_thread
):
    """``unclip shapes-eval`` (the command behind the README figures) on a saved tiny
    pipeline: every stage scored at its resolution, timings, CLIP score/FID with the real-vs-real
    floor, report JSON and grid written; with ``--oracle`` the decoder gets the true renders'
    embeddings."""
    import json

    from unclip.cli.shapes_eval import main

    tiny_pipe.save_pretrained(tmp_path / "pipe")
    few = json.dumps(
        {"prior": {"steps": 2}, "decoder": {"steps": 2, "best_of": 2}, "upsampler": {"steps": 2}}
    )
    out, grid = tmp_path / "report.json", tmp_path / "grid.png"
    assert (
        main(
            [
                "--model",
                str(tmp_path / "pipe"),
                "--num",
                "3",
                "--sampling",
                few,
                "--out",
                str(out),
                "--grid",
                str(grid),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert (
        report["num_prompts"] == {"single": 3, "pair": 3}
        and report["sampling"]["decoder"]["best_of"] == 2
    )
    assert list(report["stages"]) == ["decoder", *tiny_pipe.upsampler_names]
    assert list(report["seconds_per_image"]) == ["prior", *report["stages"]]
    assert [s["resolution"] for s in report["stages"].values()] == [16, 32, 64] and report[
        "final_stage"
    ] == "sr64"
    for stage in report["stages"].values():
        assert stage["single"]["count"] == 3 and stage["pair"]["count"] == 3
        assert all(0.0 <= v <= 1.0 for k, v in stage["single"].items() if k != "count")
    assert report["clip_fid"] > 0 and report["clip_fid_real_vs_real"] > 0
    assert (
        -100 <= report["clip_score_100"] <= 100
        and -1 <= report["prior_cosine_with_true_embed"] < 0.999
    )
    assert Image.open(grid).size == (8 * 96, 96)  # 3 single + 3 two-object tiles in one row of 8
    assert len(grid.with_suffix(".txt").read_text().splitlines()) == 6

    oracle = tmp_path / "oracle.json"
    assert (
        main(
            [
                "--model",
                str(tmp_path / "pipe"),
                "--num",
                "2",
                "--stages",
                "decoder",
                "--oracle",
                "--sampling",
                few,
                "--out",
                str(oracle),
            ]
        )
        == 0
    )
    report = json.loads(oracle.read_text())
    assert list(report["stages"]) == ["decoder"] and report["seconds_per_image"]["prior"] == 0.0
    assert report["prior_cosine_with_true_embed"] > 0.999  # the true embeddings were used


def test_shapes_eval_upsamplers_alone_take_the_true_renders(tiny_pipe, tmp_path, one_thread):
    """``--stages upsamplers``: no prior or decoder runs; the upsamplers get the held-out scenes'
    true renders at the decoder's resolution (scored as stage ``renders``), and the final images are
    exactly the upsamplers' output for those renders with the same per-image seeds."""
    import json

    import torch

    from unclip.cli.shapes_eval import main
    from unclip.shapes.evaluate import evaluate_pipeline, heldout_samples
    from unclip.utils.images import pil_to_tensor, to_output

    few = {"upsampler": {"steps": 2}}
    report = evaluate_pipeline(tiny_pipe, 2, sampling=few, stages="upsamplers", batch_size=3)
    names = tiny_pipe.upsampler_names
    assert list(report["stages"]) == ["renders", *names] and report["final_stage"] == names[-1]
    assert list(report["seconds_per_image"]) == names
    assert report["prior_cosine_with_true_embed"] is None
    renders = heldout_samples(2, 1000, tiny_pipe.decoder.config.sample_size)
    assert report["stages"]["renders"]["resolution"] == tiny_pipe.decoder.config.sample_size
    assert report["_captions"] == [s.caption for s in renders]
    x = torch.stack([pil_to_tensor(s.image) for s in renders])
    gens = [torch.Generator().manual_seed(i) for i in range(len(renders))]
    with torch.no_grad():  # in the evaluation's batches (3, then 1)
        expected = to_output(
            torch.cat(
                [
                    tiny_pipe.upsample(x[:3], generator=gens[:3], sampling=few, progress=False),
                    tiny_pipe.upsample(x[3:], generator=gens[3:], sampling=few, progress=False),
                ]
            ),
            "uint8",
        )
    assert len(report["_images"]) == 4
    for got, want in zip(report["_images"], expected):
        assert np.array_equal(got, want)

    with pytest.raises(ValueError, match="upsamplers"):
        evaluate_pipeline(tiny_pipe, 1, stages="upsamplers", oracle=True)
    tiny_pipe.save_pretrained(tmp_path / "pipe")
    out = tmp_path / "up.json"
    args = ["--model", str(tmp_path / "pipe"), "--num", "1", "--stages", "upsamplers"]
    assert main([*args, "--sampling", json.dumps(few), "--out", str(out)]) == 0
    assert list(json.loads(out.read_text())["stages"]) == ["renders", *names]
