"""Training from precomputed embeddings: the decoder on webdataset shards paired with ``unclip
embed`` output (``data.embeddings_path``), loud failures when image and embedding shards do not line
up, and the prior from ``data.source=embeddings`` using the embedding statistics of
``stats.npz``."""

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONFIGS
from safetensors.torch import load_file

from unclip.cli import embed as embed_cli
from unclip.cli import train_decoder as train_decoder_cli
from unclip.cli import train_prior
from unclip.nets.clip import CLIP
from unclip.shapes.export import write_shapes
from unclip.train import decoder as train_decoder
from unclip.train import embed
from unclip.train.config import DataConfig, load_stage_config
from unclip.train.data.loader import make_batches
from unclip.train.data.paired import PairedFolderStream, PairedWebDatasetStream, tar_keys
from unclip.train.data.sources import WebDatasetStream

DECODER, PRIOR = CONFIGS / "tiny" / "decoder.yaml", CONFIGS / "tiny" / "prior.yaml"
STEPS = 3
DECODER_LOSS = train_decoder.decoder_loss


@pytest.fixture(autouse=True)
def _reset_accelerate():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def run_embed(*args):
    with pytest.warns(UserWarning, match="randomly initialised"):
        assert (
            embed_cli.main(
                [
                    *map(str, args),
                    "--clip-config",
                    str(DECODER),
                    "--no-progress",
                    "--batch-size",
                    "4",
                ]
            )
            == 0
        )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """12 shapes samples at the decoder's 16px in 3 tar shards, embedded (float32) by the tiny CLIP
    that configs/tiny/decoder.yaml builds (YAML without weights → seed 0, like training with
    train.seed=0)."""
    root = tmp_path_factory.mktemp("paired")
    write_shapes(
        root / "shards", 12, resolution=16, format="webdataset", shard_size=4, progress=False
    )
    pattern = str(root / "shards" / "{00000..00002}.tar")
    run_embed(
        "--source", "webdataset", "--data", pattern, "--out", root / "emb", "--dtype", "float32"
    )
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return {
        "root": root,
        "pattern": pattern,
        "emb": root / "emb",
        "urls": [str(root / "shards" / f"{i:05d}.tar") for i in range(3)],
    }


def rows(emb: Path, shard: int):
    img = np.load(emb / "img_emb" / f"img_emb_{shard}.npy")
    txt = np.load(emb / "text_emb" / f"text_emb_{shard}.npy")
    meta = [
        json.loads(line)
        for line in (emb / "metadata" / f"metadata_{shard}.jsonl").read_text().splitlines()
    ]
    return img, txt, meta


def write_rows(emb: Path, shard: int, img, txt, meta):
    np.save(emb / "img_emb" / f"img_emb_{shard}.npy", img)
    np.save(emb / "text_emb" / f"text_emb_{shard}.npy", txt)
    (emb / "metadata" / f"metadata_{shard}.jsonl").write_text(
        "".join(json.dumps(m) + "\n" for m in meta)
    )
    (emb / "stats.json").unlink(missing_ok=True)  # its row/shard counts would (rightly) fail first


def stream(data, emb=None, **kw):
    kw = {"seed": 0, "rank": 0, "world_size": 1, "shuffle_buffer": 4, **kw}
    return PairedWebDatasetStream(data["pattern"], 16, emb or data["emb"], **kw)


def all_rows(emb: Path, n=3):
    out = {}
    for i in range(n):
        img, txt, meta = rows(emb, i)
        out.update({m["key"]: (img[r], txt[r], m["caption"]) for r, m in enumerate(meta)})
    return out


# ------------------------------------------------------------------------------------------------
# (a) the decoder trains on the precomputed embeddings, which equal what the frozen CLIP computes
# ------------------------------------------------------------------------------------------------
def test_paired_stream_is_the_image_stream_plus_each_samples_own_rows(data):
    table = all_rows(data["emb"])
    assert sorted(table) == [f"{i:08d}" for i in range(12)]
    plain = WebDatasetStream(data["pattern"], 16, seed=0, rank=0, world_size=1, shuffle_buffer=4)
    got = list(itertools.islice(stream(data), 30))  # 2.5 epochs
    for a, b in zip(got, itertools.islice(plain, 30)):
        assert (
            torch.equal(a["image"], b["image"])
            and a["caption"] == b["caption"]
            and a["skipped"] == 0
        )
        img, txt, caption = table[a["key"]]
        assert a["caption"] == caption
        assert torch.equal(a["image_embed"], torch.from_numpy(img)) and torch.equal(
            a["text_embed"], torch.from_numpy(txt)
        )
    assert {s["key"] for s in got} == set(table)
    # exact resume and the rank split are those of the image stream
    resumed = list(itertools.islice(stream(data, start=17), 8))
    assert [s["key"] for s in resumed] == [s["key"] for s in got[17:25]]
    r1 = list(itertools.islice(stream(data, rank=1, world_size=2), 6))
    p1 = list(
        itertools.islice(
            WebDatasetStream(data["pattern"], 16, seed=0, rank=1, world_size=2, shuffle_buffer=4), 6
        )
    )
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(r1, p1))


def test_dataloader_workers_resume_exactly_with_each_samples_rows(data):
    table = all_rows(data["emb"])
    cfg = DataConfig(
        source="webdataset",
        path=data["pattern"],
        embeddings_path=str(data["emb"]),
        batch_size=2,
        shuffle_buffer=4,
        num_workers=2,
    )
    kw = dict(resolution=16, seed=0, rank=0, world_size=1)
    full = list(itertools.islice(make_batches(cfg, **kw), 6))
    resumed = list(itertools.islice(make_batches(cfg, **kw, start=4), 4))
    assert [b["key"] for b in full[2:]] == [b["key"] for b in resumed]
    assert {k for b in full for k in b["key"]} <= set(table)
    for b in full + resumed:
        for key, image_embed in zip(b["key"], b["image_embed"]):
            assert torch.equal(image_embed, torch.from_numpy(table[key][0]))


def _train_decoder(out, monkeypatch, *overrides):
    """Train the tiny decoder; returns (batches seen, the CLIP's on-the-fly embeddings of their
    images)."""
    seen = []

    def recording(model, batch, clip, *rest):
        seen.append((batch, clip.encode_image(batch["image"])))
        return DECODER_LOSS(model, batch, clip, *rest)

    monkeypatch.setattr(train_decoder, "decoder_loss", recording)
    assert (
        train_decoder_cli.main(
            [
                str(DECODER),
                f"train.output_dir={out}",
                "train.progress=false",
                f"train.max_steps={STEPS}",
                "train.log_every=1",
                "train.warmup_steps=1",
                "data.batch_size=4",
                "data.source=webdataset",
                *overrides,
            ]
        )
        == 0
    )
    return seen


def test_decoder_trains_on_precomputed_embeddings_like_on_the_fly_clip(data, tmp_path, monkeypatch):
    common = [f"data.path={data['pattern']}", "data.shuffle_buffer=4"]
    fly = _train_decoder(tmp_path / "fly", monkeypatch, *common)
    pre = _train_decoder(
        tmp_path / "pre", monkeypatch, *common, f"data.embeddings_path={data['emb']}"
    )
    assert len(fly) == len(pre) == STEPS
    table = all_rows(data["emb"])
    for (fb, f_emb), (pb, p_emb) in zip(fly, pre):
        assert "image_embed" not in fb  # the plain run encodes images with the frozen CLIP
        assert torch.equal(fb["image"], pb["image"]) and fb["caption"] == pb["caption"]
        # the paired run uses exactly each sample's stored row …
        for key, used in zip(pb["key"], pb["image_embed"]):
            assert torch.equal(used, torch.from_numpy(table[key][0]))
        # … which is what the frozen CLIP of the training run computes on the fly (same seed, same
        # weights; only PIL vs tensor resizing inside CLIP's preprocessing differs)
        assert torch.equal(f_emb, p_emb)
        assert (pb["image_embed"] - p_emb).abs().max() < 2e-3
        assert torch.equal((pb["image_embed"] @ p_emb.T).argmax(0), torch.arange(len(p_emb)))
    losses = [
        [
            json.loads(line)["loss"]
            for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line
        ]
        for r in ("fly", "pre")
    ]
    # same losses and weights up to that resizing difference (tolerances calibrated against a run
    # whose stored rows are rolled by one within each shard: its first loss differs by 4e-4
    # relative, its weights by 0.14 L2)
    assert len(losses[0]) == STEPS and losses[0] == pytest.approx(losses[1], rel=5e-5)
    a = load_file(
        str(tmp_path / "fly" / "final" / "decoder" / "diffusion_pytorch_model.safetensors")
    )
    b = load_file(
        str(tmp_path / "pre" / "final" / "decoder" / "diffusion_pytorch_model.safetensors")
    )
    assert a.keys() == b.keys()
    assert sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5 < 0.03


# ------------------------------------------------------------------------------------------------
# (b) image and embedding shards that do not line up fail loudly, naming the shard and the key
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def damaged(data, tmp_path):
    out = tmp_path / "emb"
    shutil.copytree(data["emb"], out)
    return out


def test_missing_embedding_shard_fails_before_training(data, damaged, tmp_path):
    for sub, ext in (("img_emb", "npy"), ("text_emb", "npy"), ("metadata", "jsonl")):
        (damaged / sub / f"{sub}_2.{ext}").unlink()
    (damaged / "stats.json").unlink()
    with pytest.raises(
        ValueError,
        match=r"2 embedding shard\(s\) but data.path expands to 3 .*tar shard 2 \(.*00002.tar\)",
    ):
        train_decoder_cli.main(
            [
                str(DECODER),
                f"train.output_dir={tmp_path / 'r'}",
                "train.progress=false",
                "data.source=webdataset",
                f"data.path={data['pattern']}",
                f"data.embeddings_path={damaged}",
            ]
        )
    assert (
        not (tmp_path / "r" / "checkpoints").exists()
        and not (tmp_path / "r" / "metrics.jsonl").exists()
    )


def test_extra_embedding_shard_fails(data, damaged):
    write_rows(damaged, 3, *rows(damaged, 0))
    with pytest.raises(ValueError, match="embedding shard 3 has no tar shard"):
        stream(data, damaged)


def test_reordered_keys_fail_naming_shard_and_key(data, damaged):
    img, txt, meta = rows(damaged, 1)
    order = [1, 0, 2, 3]
    write_rows(damaged, 1, img[order], txt[order], [meta[i] for i in order])
    with pytest.raises(
        ValueError,
        match=r"shard 1 \(.*00001.tar\).*key '00000004'.*out of the tar's order.*"
        r"first mismatched key '00000005': row 0 is '00000005' where the tar's sample 0 is "
        r"'00000004'",
    ):
        stream(data, damaged)


def test_row_of_another_tar_fails(data, damaged):
    img, txt, meta = rows(damaged, 0)
    meta[2]["key"] = "00000009"
    write_rows(damaged, 0, img, txt, meta)
    with pytest.raises(
        ValueError, match=r"shard 0 \(.*00000.tar\).*key '00000009', which is not in the tar"
    ):
        stream(data, damaged)


def test_more_rows_than_tar_samples_fail(data, damaged):
    img, txt, meta = rows(damaged, 2)
    write_rows(
        damaged,
        2,
        np.concatenate([img, img[:1]]),
        np.concatenate([txt, txt[:1]]),
        meta + [{"key": "zzz", "caption": "x"}],
    )
    with pytest.raises(
        ValueError,
        match=r"shard 2 \(.*00002.tar\).*5 rows but the tar holds 4 samples; "
        r"first mismatched key 'zzz'",
    ):
        stream(data, damaged)


def test_dropped_row_fails_when_its_sample_streams(data, damaged, tmp_path):
    # one row fewer than samples could be a bad sample that `unclip embed` skipped, so the check
    # passes up front; the sample is readable, so it must have had a row: training stops naming
    # shard and key
    img, txt, meta = rows(damaged, 1)
    keep = [0, 2, 3]
    write_rows(damaged, 1, img[keep], txt[keep], [meta[i] for i in keep])
    with pytest.raises(
        ValueError, match=r"shard 1 \(.*00001.tar\).*key '00000005' has no row in embedding shard 1"
    ):
        train_decoder_cli.main(
            [
                str(DECODER),
                f"train.output_dir={tmp_path / 'r'}",
                "train.progress=false",
                "train.max_steps=20",
                "data.batch_size=4",
                "data.source=webdataset",
                f"data.path={data['pattern']}",
                f"data.embeddings_path={damaged}",
            ]
        )


def test_embeddings_of_other_data_with_the_same_keys_fail(data, tmp_path):
    write_shapes(
        tmp_path / "other",
        12,
        resolution=16,
        seed=1,
        format="webdataset",
        shard_size=4,
        progress=False,
    )
    other = str(tmp_path / "other" / "{00000..00002}.tar")
    assert [tar_keys(tmp_path / "other" / f"{i:05d}.tar") for i in range(3)] == [
        tar_keys(u) for u in data["urls"]
    ]  # same keys: only the captions tell them apart
    s = PairedWebDatasetStream(
        other, 16, data["emb"], seed=0, rank=0, world_size=1, shuffle_buffer=0
    )
    with pytest.raises(
        ValueError, match=r"shard \d \(.*other.*\).*computed for the caption .*first mismatched key"
    ):
        list(itertools.islice(s, 12))


def test_non_finite_row_is_skipped_and_counted(data, damaged):
    img, txt, meta = rows(damaged, 0)
    img[1, 3] = np.nan
    write_rows(damaged, 0, img, txt, meta)
    got = list(itertools.islice(stream(data, damaged, shuffle_buffer=0), 30))
    assert meta[1]["key"] not in {s["key"] for s in got} and len({s["key"] for s in got}) == 11
    assert (
        sum(s["skipped"] for s in got[:11]) == 1
    )  # one epoch: 11 good samples, the bad one counted


def test_folder_images_pair_by_relative_path(tmp_path):
    write_shapes(tmp_path / "imgs", 6, resolution=16, format="folder", progress=False)
    (tmp_path / "imgs" / "00000002.png").write_bytes(
        b"broken"
    )  # skipped by embed and by training alike
    run_embed(
        "--source",
        "folder",
        "--data",
        tmp_path / "imgs",
        "--out",
        tmp_path / "emb",
        "--shard-size",
        4,
    )
    _, _, meta = rows(tmp_path / "emb", 0)
    assert [m["key"] for m in meta] == ["00000000", "00000001", "00000003"]
    table = all_rows(tmp_path / "emb", 2)
    s = PairedFolderStream(
        tmp_path / "imgs", 16, tmp_path / "emb", seed=0, rank=0, world_size=1, shuffle=False
    )
    got = list(itertools.islice(s, 10))
    assert [g["key"] for g in got] == sorted(table) * 2
    assert [g["skipped"] for g in got] == [0, 0, 1, 0, 0] * 2
    for g in got:
        assert g["caption"] == table[g["key"]][2]
        assert torch.equal(
            g["image_embed"], torch.from_numpy(table[g["key"]][0].astype(np.float32))
        )
    img, txt, meta = rows(tmp_path / "emb", 1)
    write_rows(tmp_path / "emb", 1, img[:1], txt[:1], meta[:1])  # drop the row of 00000005
    s = PairedFolderStream(tmp_path / "imgs", 16, tmp_path / "emb", seed=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"shard 1 \(.*00000005.png\).*key '00000005' has no row"):
        list(itertools.islice(s, 10))


def test_embeddings_path_needs_an_image_source(data):
    from unclip.train.data.loader import make_stream

    cfg = DataConfig(source="shapes", embeddings_path=str(data["emb"]))
    with pytest.raises(ValueError, match="needs data.source webdataset or folder"):
        make_stream(cfg, resolution=16, seed=0, rank=0, world_size=1)


# ------------------------------------------------------------------------------------------------
# (c) the prior trains from the embeddings alone and normalises with stats.npz
# ------------------------------------------------------------------------------------------------
def test_prior_trains_from_embeddings_with_their_stats(data, tmp_path):
    stats = embed.load_stats(data["emb"])
    assert {"image_mean", "image_std", "text_mean", "text_std"} <= set(stats)
    out = tmp_path / "prior"
    assert (
        train_prior.main(
            [
                str(PRIOR),
                f"train.output_dir={out}",
                "train.progress=false",
                f"train.max_steps={STEPS}",
                "train.log_every=1",
                "data.batch_size=4",
                "data.source=embeddings",
                f"data.path={data['emb']}",
            ]
        )
        == 0
    )
    losses = [
        json.loads(line)["loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    w = load_file(str(out / "final" / "prior" / "diffusion_pytorch_model.safetensors"))
    mean, std = w["transformer.clip_mean"].reshape(-1), w["transformer.clip_std"].reshape(-1)
    assert torch.equal(mean, torch.from_numpy(stats["image_mean"]).float())
    assert torch.equal(std, torch.from_numpy(stats["image_std"]).float())
    # stats.npz, not statistics re-estimated from the stream (which use ddof=1 and differ)
    all_img = np.concatenate([rows(data["emb"], i)[0] for i in range(3)])
    assert not np.allclose(std.numpy(), all_img.std(0, ddof=1), rtol=1e-3, atol=0)
    # the training CLIP (same YAML clip section, train.seed 0) is the one that wrote the embeddings
    cfg = load_stage_config(PRIOR)
    torch.manual_seed(cfg.train.seed)
    clip = CLIP.from_config(cfg.clip)
    _, txt, meta = rows(data["emb"], 0)
    np.testing.assert_allclose(
        clip.encode_text([meta[0]["caption"]]).text_embed[0].numpy(), txt[0], atol=1e-5
    )
