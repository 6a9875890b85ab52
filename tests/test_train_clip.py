"""`unclip train-clip`: batches with hard negatives, a tiny end-to-end run on the shared training
loop (export, exact resume), config errors."""

import json
import random

import pytest
import torch
import yaml

from unclip.cli.train_clip import main
from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config
from unclip.shapes.captions import parse_caption
from unclip.shapes.train_clip import (
    ClipDataConfig,
    clip_batches,
    load_clip_train_config,
    make_batch,
)
from unclip.shapes.world import ShapesWorld, is_heldout


def _named(caption: str) -> dict:
    p = parse_caption(caption)
    out = {"relation": p["relation"]}
    for i, o in enumerate(p["objects"]):
        out.update({f"{k}{i}": o[k] for k in ("shape", "color", "size", "position")})
    return out


def test_batch_with_hard_negatives_pairs_each_twin_with_a_one_attribute_sibling():
    world = ShapesWorld(32, seed=0, split="train", two_object_prob=0.5)
    data = ClipDataConfig(hard_negatives=0.25, noise_prob=0.0, blur_prob=0.0)
    x, caps = make_batch(world, 2, 16, data, random.Random(0))
    assert x.shape == (16, 3, 32, 32) and len(caps) == 16
    # the first 12 are world samples 24..35 (batch 2 of 12 new scenes each), the last 4 their
    # variants
    assert caps[:12] == [world[i].caption for i in range(24, 36)]
    for base, twin, img_base, img_twin in zip(caps[:4], caps[12:], x[:4], x[12:]):
        a, b = _named(base), _named(twin)
        assert sum(a[k] != b[k] for k in a if a[k] is not None and b.get(k) is not None) == 1, (
            base,
            twin,
        )
        assert not torch.equal(img_base, img_twin)
    # without hard negatives: consecutive samples, as before
    _, plain = make_batch(world, 1, 8, ClipDataConfig(hard_negatives=0.0), random.Random(0))
    assert plain == [world[i].caption for i in range(8, 16)]


def test_batch_hard_negative_weights_choose_the_attribute_and_are_checked():
    world = ShapesWorld(32, seed=0, split="train", two_object_prob=0.5)
    data = ClipDataConfig(
        hard_negatives=0.5,
        noise_prob=0.0,
        blur_prob=0.0,
        pair_negatives={"swap": 1.0},
        single_negatives={"size": 1.0},
    )
    n = 32
    x, caps = make_batch(world, 0, n, data, random.Random(0))
    kinds = set()
    for base, twin in zip(caps[: n // 2], caps[n // 2 :]):
        a, b = _named(base), _named(twin)
        if a["relation"] is None:
            # a size twin: same shape and color; where both captions name the size, it differs
            assert (a["shape0"], a["color0"]) == (b["shape0"], b["color0"]), (base, twin)
            assert None in (a["size0"], b["size0"]) or a["size0"] != b["size0"], (base, twin)
            kinds.add("single")
        elif (b["color0"], b["color1"]) == (a["color1"], a["color0"]):
            # the pair's colors swapped: same shapes and relation, colors exchanged
            assert (a["shape0"], a["shape1"], a["relation"]) == (
                b["shape0"],
                b["shape1"],
                b["relation"],
            )
            kinds.add("pair")
        else:  # only where the swap would show a held-out combination: a default-weights twin
            x, y = parse_caption(base)["objects"]
            flipped = [{**x, "color": y["color"]}, {**y, "color": x["color"]}]
            assert is_heldout({"objects": flipped}), (base, twin)
            assert sum(a[k] != b[k] for k in a if a[k] is not None and b.get(k) is not None) == 1
            kinds.add("fallback")
    assert {"single", "pair"} <= kinds
    for bad in ({"size": 1.0}, {}, {"swap": -1.0}, {"swap": 0.0}, {"swap": True}, {"swap": "1"}):
        with pytest.raises(ValueError, match="data.pair_negatives"):
            ClipDataConfig(pair_negatives=bad)
    for bad in ({"swap": 1.0}, {"shape": float("inf")}, [("shape", 1.0)]):
        with pytest.raises(ValueError, match="data.single_negatives"):
            ClipDataConfig(single_negatives=bad)
    # from a config file's dotted overrides, as `unclip train-clip CONFIG key=value` takes them
    cfg = load_clip_train_config(
        {"clip": {"model_cfg": tiny_clip_config()}},
        ["data.hard_negatives=0.25", "data.pair_negatives={swap: 0.6, relation: 0.4}"],
    )
    assert cfg.data.pair_negatives == {"swap": 0.6, "relation": 0.4}
    with pytest.raises(ValueError, match="data.pair_negatives must be a mapping"):
        load_clip_train_config(
            {"clip": {"model_cfg": tiny_clip_config()}}, ["data.pair_negatives={size: 1}"]
        )


def test_batch_with_color_free_views_replaces_that_share_of_samples():
    world = ShapesWorld(32, seed=0, split="train", two_object_prob=0.5)
    plain = [world[i].caption for i in range(64, 128)]
    x, caps = make_batch(
        world,
        1,
        64,
        ClipDataConfig(color_free_prob=0.5, noise_prob=0.0, blur_prob=0.0),
        random.Random(0),
    )
    named = {"red", "green", "blue", "yellow", "purple", "orange"}
    free = [i for i, c in enumerate(caps) if not set(c.split()) & named]
    assert 16 <= len(free) <= 48  # about half, drawn per sample
    for i in range(64):
        if i in free:  # the same scene's shapes, named without colors
            shapes_of = [w for w in plain[i].split() if w in ("circle", "square", "triangle")]
            assert [
                w for w in caps[i].split() if w in ("circle", "square", "triangle")
            ] == shapes_of
            assert not torch.equal(
                x[i],
                make_batch(
                    world, 1, 64, ClipDataConfig(noise_prob=0.0, blur_prob=0.0), random.Random(0)
                )[0][i],
            )
        else:
            assert caps[i] == plain[i]
    again = make_batch(
        world,
        1,
        64,
        ClipDataConfig(color_free_prob=0.5, noise_prob=0.0, blur_prob=0.0),
        random.Random(0),
    )
    assert again[1] == caps and torch.equal(again[0], x)


def test_batch_with_extra_colors_names_and_draws_them_hard_negatives_too():
    extra = {"pink": [255, 105, 180], "cyan": [40, 210, 220]}
    data = ClipDataConfig(
        hard_negatives=0.5, noise_prob=0.0, blur_prob=0.0, two_object_prob=0.5, extra_colors=extra
    )
    world = ShapesWorld(32, seed=0, split="train", two_object_prob=0.5, extra_colors=extra)
    x, caps = make_batch(world, 0, 64, data, random.Random(0))
    assert caps[:32] == [world[i].caption for i in range(32)]
    pixels = ((x.permute(0, 2, 3, 1) + 1) * 127.5).round()
    for name, rgb in extra.items():
        named = [i for i, c in enumerate(caps) if name in c.split()]
        # the extra colors appear among the scenes and among their hard negatives (rendered with
        # the extra palette: without it those could not be drawn)
        assert any(i < 32 for i in named) and any(i >= 32 for i in named), (name, caps)
        for i in named:  # each image whose caption names the color shows it
            assert (pixels[i] - torch.tensor(rgb, dtype=torch.float32)).abs().amax(-1).min() < 2
    # the training loop's batches come from a world with the same palette
    first = next(clip_batches(data, seed=0, rank=0, world_size=1))
    assert any(name in c.split() for c in first["caption"] for name in extra)
    with pytest.raises(ValueError, match="data.extra_colors: extra color name 'red2'"):
        ClipDataConfig(extra_colors={"red2": [230, 40, 41]})
    with pytest.raises(ValueError, match="data.extra_colors"):
        ClipDataConfig(extra_colors={"pink": [250, 40, 40]})  # too close to red


def _config(tmp_path, **data) -> str:
    cfg = {
        "clip": {"model_name": "tiny", "model_cfg": tiny_clip_config()},
        "data": {"resolution": 32, "batch_size": 8, "two_object_prob": 0.5, **data},
        "train": {"max_steps": 3, "warmup_steps": 1, "log_every": 1, "progress": False},
        "output": {"eval_samples": 4},
    }
    path = tmp_path / "clip.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_train_clip_tiny_run_writes_a_loadable_clip_and_retrieval_report(tmp_path, one_thread):
    out = tmp_path / "run"
    assert main([_config(tmp_path, hard_negatives=0.5), "--output-dir", str(out)]) == 0
    clip = CLIP.from_pretrained(out / "final" / "clip")
    emb = clip.encode_text(["a small red circle on the left"]).text_embed
    assert emb.shape == (1, 32) and torch.isfinite(emb).all()
    report = json.loads((out / "retrieval.json").read_text())
    assert report["steps"] == 3
    assert set(report["retrieval_heldout"]) == {
        "color",
        "shape",
        "size",
        "position",
        "background",
        "relation",
        "pair_color",
        "pair_shape",
        "pair_background",
    }
    assert all(0.0 <= v <= 1.0 for v in report["retrieval_heldout"].values())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


def test_train_clip_refuses_a_hard_negative_share_above_half(tmp_path):
    with pytest.raises(ValueError, match="hard_negatives"):
        main([_config(tmp_path, hard_negatives=0.75), "--output-dir", str(tmp_path / "run")])
    with pytest.raises(ValueError, match="color_free_prob must be a probability"):
        main([_config(tmp_path, color_free_prob=1.5), "--output-dir", str(tmp_path / "run")])


def test_train_clip_resumes_exactly(tmp_path, one_thread):
    """The CLIP trainer runs on the shared loop: stopped after 2 of 4 steps and resumed, it ends
    with the weights of an uninterrupted run."""
    cfg = _config(tmp_path)
    common = [
        cfg,
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "output.eval_samples=2",
        "output.save_dtype=float32",
    ]
    assert main([*common, "--output-dir", str(tmp_path / "full")]) == 0
    split = ["--output-dir", str(tmp_path / "split")]
    assert main([*common, *split, "--max-steps-this-run", "2"]) == 0
    assert not (tmp_path / "split" / "final").exists()
    assert main([*common, *split, "--resume", "latest"]) == 0
    a = CLIP.from_pretrained(tmp_path / "full" / "final" / "clip").model.state_dict()
    b = CLIP.from_pretrained(tmp_path / "split" / "final" / "clip").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)  # train.seed: the initialisation of both runs
    init = CLIP.from_config(ClipConfig("tiny", None, tiny_clip_config())).model.state_dict()
    assert max(float((init[k] - a[k]).abs().max()) for k in a) > 1e-4  # it did train
