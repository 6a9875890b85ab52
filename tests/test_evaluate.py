"""Evaluation: Fréchet distance, FID Inception loading, CLIP score, shapes faithfulness,
`unclip evaluate`."""

import hashlib
import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from unclip.cli import run_command
from unclip.cli.evaluate import main
from unclip.eval import metrics as M
from unclip.eval.evaluate import read_coco_captions, read_prompts
from unclip.nets.clip import CLIP
from unclip.pipeline.tiny import tiny_pipeline
from unclip.sampling.utils import sample_seed
from unclip.shapes.export import write_shapes
from unclip.shapes.world import ShapesWorld

FAST_FID = [
    "--inception",
    "random",
    "--inception-feature",
    "64",
]  # test-only Inception, 64-d features


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_pipeline().save_pretrained(path)  # 16 → 32 → 64 px
    return path


@pytest.fixture(scope="module")
def gt_dir(tmp_path_factory):
    """Ground-truth shapes renders (held-out split, 64 px) with .txt captions."""
    path = tmp_path_factory.mktemp("gt")
    write_shapes(path, 120, resolution=64, seed=3, split="heldout", progress=False)
    return path


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref")
    write_shapes(path, 6, resolution=64, seed=1, split="train", progress=False)
    return path


def _subset(src, dst, n):
    dst.mkdir()
    for p in sorted(src.glob("*.png"))[:n]:
        shutil.copy(p, dst / p.name)
        shutil.copy(p.with_suffix(".txt"), dst / f"{p.stem}.txt")
    return dst


def _run(argv):
    assert main([*argv, "--no-progress", "--device", "cpu"]) == 0


def _fails(argv, capsys) -> str:
    """The one stderr line of ``unclip evaluate argv`` failing with exit status 1, as the README
    promises for user errors (no usage dump, no status 2)."""
    assert run_command("evaluate", [*argv, "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    # the error is the last line, after at most the banner of the test-only random Inception
    assert err.endswith("\n") and "usage:" not in err, err
    assert err.splitlines()[-1].startswith("unclip evaluate: error: "), err
    return err.splitlines()[-1]


# ------------------------------------------------------------------------------- Fréchet distance
def test_frechet_distance_matches_closed_form_for_diagonal_gaussians():
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    v1, v2 = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 6)
    expected = ((mu1 - mu2) ** 2).sum() + (v1 + v2 - 2 * np.sqrt(v1 * v2)).sum()
    assert M.frechet_distance(mu1, np.diag(v1), mu2, np.diag(v2)) == pytest.approx(
        expected, rel=1e-9
    )
    # a rotation of both Gaussians leaves the distance unchanged (exercises non-diagonal
    # covariances)
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    got = M.frechet_distance(q @ mu1, q @ np.diag(v1) @ q.T, q @ mu2, q @ np.diag(v2) @ q.T)
    assert got == pytest.approx(expected, rel=1e-7)
    assert M.frechet_distance(mu1, np.diag(v1), mu1, np.diag(v1)) == pytest.approx(0, abs=1e-10)


def test_frechet_distance_singular_covariances_and_bad_shapes():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 12))  # fewer samples than dimensions: rank-deficient covariance
    s = M.GaussianStats()
    s.update(x[:2])
    s.update(x[2:])
    mu, sigma = s.mu_sigma()
    np.testing.assert_allclose(mu, x.mean(0), atol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(x, rowvar=False), atol=1e-12)
    assert abs(M.frechet_distance(mu, sigma, mu, sigma)) < 1e-4
    assert M.frechet_distance(mu, sigma, mu + 1.0, sigma) == pytest.approx(12.0, abs=1e-3)
    with pytest.raises(ValueError, match="shapes"):
        M.frechet_distance(mu, sigma, mu[:3], sigma)
    with pytest.raises(ValueError, match="NaN"):
        M.frechet_distance(mu * np.nan, sigma, mu, sigma)


def test_fid_of_a_set_against_itself_is_zero_and_grows_with_noise():
    inception, ident = M.load_inception("random", 64)
    assert ident["comparable"] is False
    world = ShapesWorld(64, seed=0, split="all")
    images = np.stack([np.asarray(world[i].image) for i in range(6)]).astype(np.float64)
    noise = np.random.default_rng(0).normal(size=images.shape)
    levels = [0, 15, 40, 100]
    batch = [
        a for s in levels for a in np.clip(images + s * noise, 0, 255).round().astype(np.uint8)
    ]
    feats = M.inception_features(inception, batch).numpy().reshape(len(levels), 6, -1)

    def stats(f):
        g = M.GaussianStats()
        g.update(f)
        return g.mu_sigma()

    base = stats(feats[0])
    fids = [M.frechet_distance(*base, *stats(f)) for f in feats]
    assert abs(fids[0]) < 1e-4
    assert all(a < b for a, b in zip(fids, fids[1:])), fids


# -------------------------------------------------------------------------------- Inception loading
def test_inception_loads_from_a_local_file_and_fails_clearly_without_it(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    random_net, _ = M.load_inception("random", 64)
    path = tmp_path / "inception.safetensors"
    save_file(random_net.net.state_dict(), path)
    loaded, ident = M.load_inception(str(path), 64)
    x = torch.randint(0, 256, (2, 3, 40, 40), dtype=torch.uint8)
    torch.testing.assert_close(loaded(x), random_net(x))
    assert ident["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    save_file({"fc.weight": torch.zeros(3, 3)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not the FID Inception"):
        M.load_inception(str(tmp_path / "other.safetensors"), 64)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_home"))
    with pytest.raises(FileNotFoundError) as e:
        M.load_inception(None)
    assert M.INCEPTION_FILE in str(e.value) and M.INCEPTION_URL in str(e.value)


def test_only_the_real_inception_file_is_comparable_and_other_pickles_are_refused(tmp_path):
    random_net, _ = M.load_inception("random", 2048)
    # a correctly shaped file, even at 2048-d, is not the real one: not comparable
    save_file_path = tmp_path / "inception.safetensors"
    from safetensors.torch import save_file

    save_file(random_net.net.state_dict(), save_file_path)
    ident = M.load_inception(str(save_file_path), 2048)[1]
    assert ident["comparable"] is False and ident["verified"] is False
    assert "unverified" in ident["name"]
    # a pickle under the real file's name but with other contents is refused, saying the rule
    fake = tmp_path / M.INCEPTION_FILE
    torch.save(random_net.net.state_dict(), fake)
    with pytest.raises(ValueError) as e:
        M.load_inception(str(fake), 2048)
    message = str(e.value)
    assert "pickles (.pth, .pt, .bin) are not loaded" in message
    assert M.INCEPTION_SHA256_PREFIX in message and "weights_only=True" in message
    assert ".safetensors" in message and "\n" not in message
    # a folder holding it names the same file
    with pytest.raises(ValueError, match="refusing"):
        M.load_inception(str(tmp_path), 2048)


def test_evaluate_without_inception_weights_names_the_file(
    gt_dir, ref_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    err = _fails(
        [
            "--samples",
            str(gt_dir),
            "--reference",
            str(ref_dir),
            "--out",
            str(tmp_path / "o"),
            "--allow-small-reference",
            "--resolution",
            "64",
        ],
        capsys,
    )
    assert (
        M.INCEPTION_FILE in err
        and "--inception" in err
        and "github.com/toshas/torch-fidelity" in err
    )


# ------------------------------------------------------------------------------------- CLIP score
def test_clip_score_ranks_matching_pairs_above_mismatched():
    g = torch.Generator().manual_seed(0)
    text = torch.randn(16, 32, generator=g)
    image = 3.0 * (
        text + 0.7 * torch.randn(16, 32, generator=g)
    )  # unnormalised, correlated with its text
    matched = M.clip_cosines(image, text)
    for shift in range(1, 16):
        mismatched = M.clip_cosines(image, text.roll(shift, dims=0))
        assert (matched > mismatched).all()
    torch.testing.assert_close(
        matched, (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)
    )
    s = M.clip_score_summary(torch.tensor([0.5, -0.2, 0.3]))
    assert s["clip_score_100"] == pytest.approx((50 + 0 + 30) / 3)
    assert s["clipscore_2.5"] == pytest.approx((1.25 + 0 + 0.75) / 3)
    assert s["cosine_mean"] == pytest.approx(0.2) and s["negative_count"] == 1 and s["count"] == 3
    with pytest.raises(ValueError):
        M.clip_cosines(image, text[:3])


def _manual_cosines(clip: CLIP, images, captions):
    """CLIP cosines straight from open_clip (its own preprocessing, encode_image/encode_text)."""
    with torch.no_grad():
        img = clip.model.encode_image(torch.stack([clip.preprocess(i) for i in images]))
        txt = clip.model.encode_text(clip.tokenizer(captions))
    return (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1).double()


def test_clip_score_with_a_separate_evaluation_clip(gt_dir, tmp_path):
    other = tiny_pipeline(seed=5).clip
    other.save_pretrained(tmp_path / "eval_clip")
    samples = _subset(gt_dir, tmp_path / "s", 6)
    _run(
        [
            "--samples",
            str(samples),
            "--clip-model",
            str(tmp_path / "eval_clip"),
            "--out",
            str(tmp_path / "o"),
            "--resolution",
            "64",
        ]
    )
    r = json.loads((tmp_path / "o" / "report.json").read_text())
    assert str(tmp_path / "eval_clip") in r["clip_score"]["model"]
    files = sorted(samples.glob("*.png"))
    cos = _manual_cosines(
        other,
        [Image.open(p).convert("RGB") for p in files],
        [p.with_suffix(".txt").read_text().strip() for p in files],
    )
    assert r["clip_score"]["cosine_mean"] == pytest.approx(float(cos.mean()), abs=1e-5)
    assert r["clip_score"]["clip_score_100"] == pytest.approx(
        float((100 * cos).clamp(min=0).mean()), abs=1e-3
    )


# ----------------------------------------------------------------------------------- end to end
def test_evaluate_end_to_end_offline(model_dir, ref_dir, tmp_path, capsys):
    out = tmp_path / "out"
    _run(
        [
            "--model",
            str(model_dir),
            "--shapes",
            "--num-samples",
            "4",
            "--batch-size",
            "2",
            "--reference",
            str(ref_dir),
            *FAST_FID,
            "--clip-fid",
            "--resolution",
            "64",
            "--save-samples",
            # full precision: the batch-size comparison below is of float summation order only
            "--autocast",
            "none",
            "--out",
            str(out),
        ]
    )
    assert "NOT comparable" in capsys.readouterr().err  # loud warning for the random Inception
    r = json.loads((out / "report.json").read_text())
    assert (
        r["num_samples"] == 4
        and r["fid"]["reference_count"] == 6
        and r["fid"]["comparable"] is False
    )
    # FID on 4 samples is recorded and warned about as not comparable with published FID
    assert r["fid"]["few_samples"] is True and r["fid"]["inception_verified"] is False
    assert any("fewer than 2048" in w and "NOT comparable" in w for w in r["warnings"])
    assert math.isfinite(r["fid"]["value"]) and r["fid"]["value"] > 0
    assert (
        math.isfinite(r["clip_fid"]["value"]) and "pipeline's own CLIP" in r["clip_score"]["model"]
    )
    assert r["shapes"]["count"] == 4 and 0 <= r["shapes"]["all"] <= 1
    assert r["autocast_dtype"] is None  # what the samples were computed in
    md = (out / "report.md").read_text()
    assert (
        "| metric | value | details |" in md
        and "| FID |" in md
        and "CLIPScore" in md
        and "NOT COMPARABLE" in md
    )
    assert Image.open(out / "grid.png").size == (128, 128)  # 2 x 2 tiles of 64 px
    prompts = (out / "prompts.txt").read_text().splitlines()
    assert len(prompts) == 4
    # CLIP score is the pipeline CLIP's cosine on exactly the evaluated images and prompts
    clip = CLIP.from_pretrained(model_dir / "clip")
    samples = [Image.open(out / "samples" / f"{i:06d}.png").convert("RGB") for i in range(4)]
    cos = _manual_cosines(clip, samples, prompts)
    assert r["clip_score"]["cosine_mean"] == pytest.approx(float(cos.mean()), abs=1e-5)
    assert r["clip_score"]["clipscore_2.5"] == pytest.approx(
        float((2.5 * cos).clamp(min=0).mean()), abs=1e-5
    )

    # same seed, other batch size, cached reference .npz: the same samples (per-sample seeds)
    out2 = tmp_path / "out2"
    _run(
        [
            "--model",
            str(model_dir),
            "--shapes",
            "--num-samples",
            "2",
            "--batch-size",
            "1",
            "--reference",
            str(out / "reference_stats.npz"),
            *FAST_FID,
            "--resolution",
            "64",
            "--save-samples",
            "--autocast",
            "none",
            "--out",
            str(out2),
        ]
    )
    r2 = json.loads((out2 / "report.json").read_text())
    assert (out2 / "prompts.txt").read_text().splitlines() == prompts[:2]
    for i in range(2):
        a = np.asarray(Image.open(out / "samples" / f"{i:06d}.png"), dtype=float)
        b = np.asarray(Image.open(out2 / "samples" / f"{i:06d}.png"), dtype=float)
        assert np.abs(a - b).mean() < 1.0  # float noise of batched convolutions only
    assert r2["fid"]["reference_count"] == 6 and math.isfinite(r2["fid"]["value"])
    assert sample_seed(0, 1) != sample_seed(1, 0)


def test_cached_reference_stats_reproduce_fid_and_are_refused_for_another_protocol(
    ref_dir, gt_dir, model_dir, tmp_path, capsys
):
    samples = _subset(gt_dir, tmp_path / "s", 4)
    ref = tmp_path / "ref"
    shutil.copytree(ref_dir, ref)
    argv = ["--samples", str(samples), *FAST_FID, "--allow-small-reference"]
    _run([*argv, "--reference", str(ref), "--resolution", "64", "--out", str(tmp_path / "a")])
    npz = tmp_path / "a" / "reference_stats.npz"
    meta, arrays = M.load_stats(npz)
    assert meta["count"] == 6 and meta["resolution"] == 64 and arrays["mu"].shape == (64,)
    capsys.readouterr()
    cached = ["--reference", str(ref), "--reference-cache", str(npz), "--resolution", "64"]
    _run([*argv, *cached, "--out", str(tmp_path / "a2")])
    assert "reusing reference statistics" in capsys.readouterr().err
    shutil.copy(
        sorted(gt_dir.glob("*.png"))[-1], ref / "extra.png"
    )  # the folder changed: the cache is stale
    _run([*argv, *cached, "--out", str(tmp_path / "a3")])
    assert "reusing" not in capsys.readouterr().err and M.load_stats(npz)[0]["count"] == 7
    M.save_stats(npz, meta, **arrays)  # restore the 6-image stats
    _run([*argv, "--reference", str(npz), "--resolution", "64", "--out", str(tmp_path / "b")])
    fid_a, fid_b = (
        json.loads((tmp_path / d / "report.json").read_text())["fid"]["value"] for d in "ab"
    )
    assert fid_b == pytest.approx(fid_a, rel=1e-9)
    err = _fails(
        [*argv, "--reference", str(npz), "--resolution", "32", "--out", str(tmp_path / "c")], capsys
    )
    assert "resolution" in err and "recompute" in err
    err = _fails(
        [
            "--model",
            str(model_dir),
            "--shapes",
            "--num-samples",
            "8",
            *FAST_FID,
            "--reference",
            str(npz),
            "--resolution",
            "64",
            "--out",
            str(tmp_path / "d"),
        ],
        capsys,
    )  # fails before sampling
    assert "6 images" in err and "8 samples" in err and "--allow-small-reference" in err


# ------------------------------------------------------------------------------------------ shapes
CHANCE = {
    "color": 1 / 6,
    "shape": 1 / 3,
    "size": 1 / 2,
    "position": 1 / 5,
    "background": 1 / 3,
    "colors": 1 / 6,
    "shapes": 1 / 3,
    "relation": 1 / 4,
}


def test_shapes_faithfulness_on_ground_truth_and_noise(gt_dir, tmp_path):
    _run(
        ["--samples", str(gt_dir), "--shapes", "--resolution", "64", "--out", str(tmp_path / "gt")]
    )
    r = json.loads((tmp_path / "gt" / "report.json").read_text())["shapes"]
    assert r["count"] == 120 and r["single"]["count"] > 0 and r["pair"]["count"] > 0
    for kind in ("single", "pair"):
        for key, value in r[kind].items():
            if key != "count" and not key.endswith("_count"):
                assert value >= 0.99, (kind, key, value)
    assert r["all"] >= 0.99

    noise = tmp_path / "noise"
    noise.mkdir()
    rng = np.random.default_rng(0)
    for p in sorted(gt_dir.glob("*.txt")):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
            noise / f"{p.stem}.png"
        )
        shutil.copy(p, noise / p.name)
    _run(["--samples", str(noise), "--shapes", "--resolution", "64", "--out", str(tmp_path / "n")])
    r = json.loads((tmp_path / "n" / "report.json").read_text())["shapes"]
    for kind in ("single", "pair"):
        for key, value in r[kind].items():
            if key in CHANCE:
                assert value <= CHANCE[key] + 0.15, (kind, key, value)
    assert r["all"] <= 0.05


def test_shapes_prompts_must_be_shapes_captions(model_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a red circle on the left\na photo of a dog\n")
    err = _fails(
        [
            "--model",
            str(model_dir),
            "--prompts",
            str(tmp_path / "p.txt"),
            "--shapes",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "prompt 2" in err and "not a shapes caption" in err


# --------------------------------------------------------------------------------------- bad input
def test_blank_prompt_lines_are_skipped_and_counted(model_dir, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a red circle on the left\n\n   \nan orange square at the top\n")
    assert read_prompts(f) == (["a red circle on the left", "an orange square at the top"], 2)
    _run(
        [
            "--model",
            str(model_dir),
            "--prompts",
            str(f),
            "--out",
            str(tmp_path / "o"),
            "--resolution",
            "64",
        ]
    )
    r = json.loads((tmp_path / "o" / "report.json").read_text())
    assert r["skipped"]["blank_prompt_lines"] == 2 and r["num_samples"] == 2
    assert any("blank" in w for w in r["warnings"])
    assert "skipped: blank_prompt_lines | 2" in (tmp_path / "o" / "report.md").read_text()
    assert (tmp_path / "o" / "prompts.txt").read_text().splitlines() == read_prompts(f)[0]


def test_non_utf8_prompt_file_is_a_clear_error(model_dir, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_bytes(b"a red circle on the left\nan orange \xff square\n")
    err = _fails(
        ["--model", str(model_dir), "--prompts", str(f), "--out", str(tmp_path / "o")], capsys
    )
    assert str(f) in err and "line 2" in err and "UTF-8" in err


def test_empty_reference_folder_is_an_error(gt_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _fails(
        [
            "--samples",
            str(gt_dir),
            "--reference",
            str(tmp_path / "empty"),
            *FAST_FID,
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "contains no images" in err


def test_unreadable_images_are_skipped_and_counted(gt_dir, ref_dir, tmp_path):
    ref = tmp_path / "ref"
    shutil.copytree(ref_dir, ref)
    (ref / "zz_broken.png").write_bytes(b"not an image")
    samples = _subset(gt_dir, tmp_path / "s", 5)
    (samples / "zz_broken.png").write_bytes(b"\x89PNG truncated")
    (samples / "zz_broken.txt").write_text("a red circle on the left\n")
    _run(
        [
            "--samples",
            str(samples),
            "--reference",
            str(ref),
            *FAST_FID,
            "--resolution",
            "64",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    r = json.loads((tmp_path / "o" / "report.json").read_text())
    assert r["skipped"]["unreadable_reference_images"] == 1 and r["fid"]["reference_count"] == 6
    assert r["skipped"]["unreadable_samples"] == 1 and r["num_samples"] == 5
    assert any("could not be read" in w for w in r["warnings"])


def test_reference_smaller_than_samples_needs_explicit_flag(gt_dir, ref_dir, tmp_path, capsys):
    samples = _subset(gt_dir, tmp_path / "s", 8)
    argv = ["--samples", str(samples), "--reference", str(ref_dir), *FAST_FID, "--resolution", "64"]
    err = _fails([*argv, "--out", str(tmp_path / "a")], capsys)
    assert "6 images" in err and "8 samples" in err and "--allow-small-reference" in err
    _run([*argv, "--allow-small-reference", "--out", str(tmp_path / "b")])
    assert math.isfinite(json.loads((tmp_path / "b" / "report.json").read_text())["fid"]["value"])


def test_bad_sampling_override_fails_before_work(model_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("a red circle on the left\n")
    err = _fails(
        [
            "--model",
            str(model_dir),
            "--prompts",
            str(tmp_path / "p.txt"),
            "--out",
            str(tmp_path / "o"),
            "--sampling",
            '{"decoder": {"stepz": 3}}',
        ],
        capsys,
    )
    assert "stepz" in err and not (tmp_path / "o" / "report.json").exists()


# ------------------------------------------------------------------------------------------- COCO
def test_coco_captions_are_sampled_reproducibly(tmp_path):
    anns = [
        {"id": i, "image_id": 100 + i // 2, "caption": f"  caption\n number {i} "}
        for i in range(10)
    ]
    f = tmp_path / "captions.json"
    f.write_text(json.dumps({"images": [], "annotations": anns[::-1]}))
    a = read_coco_captions(f, 4, seed=0)
    assert a == read_coco_captions(f, 4, seed=0) and len(set(a)) == 4
    assert all(c.startswith("caption number ") for c in a)
    assert read_coco_captions(f, 4, seed=1) != a
    assert sorted(read_coco_captions(f, 10, seed=0)) == sorted(
        f"caption number {i}" for i in range(10)
    )
    with pytest.raises(ValueError, match="only 10"):
        read_coco_captions(f, 11, seed=0)
    (tmp_path / "bad.json").write_text('{"images": []}')
    with pytest.raises(ValueError, match="annotations"):
        read_coco_captions(tmp_path / "bad.json", 1, seed=0)
