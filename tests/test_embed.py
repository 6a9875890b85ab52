"""``unclip embed``: clip-retrieval layout, exact statistics, read-back through EmbeddingStream,
loud failures on mismatched shards, and a 2-process torchrun run equal to a 1-process one."""

import itertools
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, TORCHRUN

from unclip.cli import embed as embed_cli
from unclip.nets.clip import CLIP, tiny_clip_config
from unclip.shapes.export import write_shapes
from unclip.train import embed
from unclip.train.data.embeddings import EmbeddingStream
from unclip.train.data.sources import open_rgb

# Accelerate keeps process-wide state that a later test must not inherit
pytestmark = pytest.mark.usefixtures("reset_accelerate")


@pytest.fixture(scope="module")
def clip(clip_dir):
    return CLIP.from_pretrained(clip_dir)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_shapes(root, 11, resolution=32, format="folder", progress=False)
    write_shapes(
        root / "jpg",
        2,
        resolution=32,
        format="folder",
        image_format="jpg",
        start_index=100,
        progress=False,
    )
    (root / "00000004.png").write_bytes(b"broken")  # replaces a real image: unreadable
    (root / "00000007.txt").unlink()  # no caption
    return root


def run(args):
    assert embed_cli.main([*map(str, args), "--no-progress"]) == 0


def read_layout(out):
    shards = sorted(int(p.stem.split("_")[-1]) for p in (out / "img_emb").glob("img_emb_*.npy"))
    img = [np.load(out / "img_emb" / f"img_emb_{i}.npy") for i in shards]
    txt = [np.load(out / "text_emb" / f"text_emb_{i}.npy") for i in shards]
    meta = [
        [
            json.loads(line)
            for line in (out / "metadata" / f"metadata_{i}.jsonl").read_text().splitlines()
        ]
        for i in shards
    ]
    return shards, img, txt, meta


@pytest.fixture(scope="module")
def folder_out(tmp_path_factory, folder, clip_dir):
    out = tmp_path_factory.mktemp("emb") / "out"
    run(
        [
            "--source",
            "folder",
            "--data",
            folder,
            "--clip-config",
            clip_dir,
            "--out",
            out,
            "--shard-size",
            5,
            "--batch-size",
            3,
            "--dtype",
            "float32",
        ]
    )
    yield out
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def test_folder_embed_writes_layout_with_right_rows(folder_out, folder, clip):
    shards, img, txt, meta = read_layout(folder_out)
    assert shards == [0, 1, 2]  # 13 files in chunks of 5
    assert [len(m) for m in meta] == [
        4,
        4,
        3,
    ]  # 00000004 (unreadable) and 00000007 (no caption) skipped
    keys = [m["key"] for ms in meta for m in ms]
    assert keys == [f"{i:08d}" for i in range(11) if i not in (4, 7)] + [
        "jpg/00000100",
        "jpg/00000101",
    ]
    for a, b, m in zip(img, txt, meta):
        assert a.dtype == np.float32 and a.shape == (len(m), clip.embed_dim) and b.shape == a.shape
    # rows are the CLIP embeddings of exactly the named file and caption
    for shard, row in ((0, 0), (1, 2), (2, 2)):
        m = meta[shard][row]
        file = folder / (m["key"] + (".jpg" if m["key"].startswith("jpg/") else ".png"))
        assert m["caption"] == file.with_suffix(".txt").read_text().strip()
        want_img = clip.encode_image([open_rgb(file)])[0].numpy()
        want_txt = clip.encode_text([m["caption"]]).text_embed[0].numpy()
        np.testing.assert_allclose(img[shard][row], want_img, atol=1e-5)
        np.testing.assert_allclose(txt[shard][row], want_txt, atol=1e-5)
    stats = json.loads((folder_out / "stats.json").read_text())
    assert stats["count"] == 11 and stats["skipped"] == 2 and stats["num_shards"] == 3
    assert not list(folder_out.rglob("*.tmp"))


def test_stats_match_numpy_over_written_embeddings(folder_out):
    _, img, txt, _ = read_layout(folder_out)
    img, txt = np.concatenate(img).astype(np.float64), np.concatenate(txt).astype(np.float64)
    stats = embed.load_stats(folder_out)
    for name, arr in (("image", img), ("text", txt)):
        np.testing.assert_allclose(stats[f"{name}_mean"], arr.mean(0), atol=1e-9)
        np.testing.assert_allclose(stats[f"{name}_std"], arr.std(0), atol=1e-7)
    assert int(stats["count"]) == len(img)
    meta = json.loads((folder_out / "stats.json").read_text())
    np.testing.assert_allclose(meta["image_std"], img.std(0), atol=1e-7)


def test_embedding_stream_reads_the_written_rows_back(folder_out):
    _, img, txt, meta = read_layout(folder_out)
    by_caption = {
        m["caption"]: (a, b) for ms, ia, ta in zip(meta, img, txt) for m, a, b in zip(ms, ia, ta)
    }
    epoch = list(itertools.islice(EmbeddingStream(folder_out, seed=0, rank=0, world_size=1), 11))
    assert sorted(s["caption"] for s in epoch) == sorted(by_caption)
    for s in epoch:
        a, b = by_caption[s["caption"]]
        assert torch.equal(s["image_embed"], torch.from_numpy(a)) and torch.equal(
            s["text_embed"], torch.from_numpy(b)
        )
        assert s["skipped"] == 0


def test_webdataset_and_shapes_sources_and_fp16_default(tmp_path, clip_dir):
    write_shapes(
        tmp_path / "wds", 7, resolution=32, format="webdataset", shard_size=3, progress=False
    )
    out = tmp_path / "wout"
    run(
        [
            "--source",
            "webdataset",
            "--data",
            tmp_path / "wds" / "{00000..00002}.tar",
            "--clip-config",
            clip_dir,
            "--out",
            out,
            "--batch-size",
            2,
        ]
    )
    shards, img, _, meta = read_layout(out)
    assert shards == [0, 1, 2] and [len(m) for m in meta] == [
        3,
        3,
        1,
    ]  # one output shard per tar shard
    assert [m["key"] for ms in meta for m in ms] == [f"{i:08d}" for i in range(7)]
    assert img[0].dtype == np.float16
    np.testing.assert_allclose(np.linalg.norm(img[0].astype(np.float32), axis=1), 1, atol=2e-3)
    out2 = tmp_path / "sout"
    run(
        [
            "--source",
            "shapes",
            "--num",
            7,
            "--clip-config",
            clip_dir,
            "--out",
            out2,
            "--shard-size",
            4,
            "--resolution",
            32,
        ]
    )
    _, img2, _, meta2 = read_layout(out2)
    assert [len(m) for m in meta2] == [4, 3]
    assert [m["caption"] for ms in meta2 for m in ms] == [m["caption"] for ms in meta for m in ms]
    # same images, same embeddings (up to fp16 rounding of results from differently sized batches)
    np.testing.assert_allclose(
        np.concatenate(img2).astype(np.float32), np.concatenate(img).astype(np.float32), atol=1e-3
    )


def test_existing_output_needs_overwrite(folder_out, tmp_path, clip_dir):
    with pytest.raises(ValueError, match="--overwrite"):
        run(["--source", "shapes", "--num", 2, "--clip-config", clip_dir, "--out", folder_out])


def test_clip_from_yaml_is_the_same_on_every_load(tmp_path):
    cfg = tmp_path / "clip.yaml"
    cfg.write_text(
        yaml.safe_dump({"clip": {"model_name": "tiny", "model_cfg": tiny_clip_config()}})
    )
    with pytest.warns(UserWarning, match="randomly initialised"):
        a, b = embed.load_clip(str(cfg)), embed.load_clip(str(cfg))
    assert torch.equal(
        a.encode_text(["a red circle"]).text_embed, b.encode_text(["a red circle"]).text_embed
    )
    with pytest.raises(ValueError, match="clip/config.json"):
        embed.load_clip(str(tmp_path))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("drop_text_row", r"shard 1 does not line up.*img_emb_1 has 4 rows, text_emb_1 3"),
        ("drop_meta_row", r"shard 2 does not line up.*metadata_2 2"),
        ("delete_img_shard", r"shard 0 is missing from img_emb"),
        ("delete_whole_shard", r"stats.json records 3 shards"),
    ],
)
def test_mismatched_shards_fail_loudly(folder_out, tmp_path, damage, message):
    out = tmp_path / "copy"
    shutil.copytree(folder_out, out)
    if damage == "drop_text_row":
        f = out / "text_emb" / "text_emb_1.npy"
        np.save(f, np.load(f)[:-1])
    elif damage == "drop_meta_row":
        f = out / "metadata" / "metadata_2.jsonl"
        f.write_text("".join(line + "\n" for line in f.read_text().splitlines()[:-1]))
    elif damage == "delete_img_shard":
        (out / "img_emb" / "img_emb_0.npy").unlink()
    else:
        for sub, ext in (("img_emb", "npy"), ("text_emb", "npy"), ("metadata", "jsonl")):
            (out / sub / f"{sub}_1.{ext}").unlink()
    with pytest.raises(ValueError, match=message):
        EmbeddingStream(out, seed=0, rank=0, world_size=1)


def test_two_process_torchrun_matches_one_process(folder_out, folder, clip_dir, tmp_path):
    out = tmp_path / "two"
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        *TORCHRUN,
        "-m",
        "unclip.cli.embed",
        "--source",
        "folder",
        "--data",
        str(folder),
        "--clip-config",
        str(clip_dir),
        "--out",
        str(out),
        "--shard-size",
        "5",
        "--batch-size",
        "3",
        "--dtype",
        "float32",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = read_layout(folder_out), read_layout(out)
    assert one[0] == two[0] == [0, 1, 2] and one[3] == two[3]  # same shards, same keys and captions
    for a, b in zip(one[1] + one[2], two[1] + two[2]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    s1, s2 = embed.load_stats(folder_out), embed.load_stats(out)
    for k in ("image_mean", "image_std", "text_mean", "text_std"):
        np.testing.assert_allclose(s1[k], s2[k], atol=1e-7)
    meta = json.loads((out / "stats.json").read_text())
    assert meta["num_processes"] == 2 and meta["count"] == 11 and meta["skipped"] == 2
