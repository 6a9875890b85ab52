"""Training data sources: folder, webdataset and embedding streams — determinism, exact resume, rank
and worker splits, bad-sample skipping and counting, DataLoader integration."""

import functools
import io
import itertools
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from unclip.shapes.export import write_shapes
from unclip.train.data.batching import StreamDataset, collate
from unclip.train.data.embeddings import EmbeddingStream
from unclip.train.data.sources import FolderStream, WebDatasetStream, image_to_tensor
from unclip.train.data.tars import iter_tar_samples, read_listed, shard_listing
from unclip.utils.images import list_images

R = 16


def take(stream, n):
    return list(itertools.islice(iter(stream), n))


def sig(sample):
    """A hashable identity of a sample (caption + pixel/embedding checksum)."""
    t = sample.get("image", sample.get("image_embed"))
    return (
        sample["caption"],
        round(float(t.double().sum()), 4),
        round(float(t.double().abs().sum()), 4),
    )


def assert_same(a, b):
    """Same samples and positions (a webdataset cursor's shard counts, what the stream learnt since
    its previous sample, differ in a resumed stream)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k == "data_cursor":
                assert x[k][:3] == y[k][:3], k
            elif isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def jpeg_bytes(img, quality=90):
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Folder
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    write_shapes(root, 10, resolution=24, format="folder", progress=False)
    for txt in root.glob("*.txt"):  # make captions unique so samples are identifiable
        txt.write_text(f"{txt.stem}: {txt.read_text()}")
    return root


@pytest.fixture(scope="module")
def dirty_folder(tmp_path_factory, clean_folder):
    root = tmp_path_factory.mktemp("dirty")
    for f in clean_folder.iterdir():
        if f.suffix in (".png", ".txt"):
            (root / f.name).write_bytes(f.read_bytes())
    (root / "00000002a.png").write_bytes(b"this is not a png at all")
    (root / "00000002a.txt").write_text("garbage image")
    good_jpg = jpeg_bytes(Image.new("RGB", (40, 40), (200, 30, 30)))
    (root / "00000005a.jpg").write_bytes(good_jpg[: len(good_jpg) // 2])
    (root / "00000005a.txt").write_text("truncated jpeg")
    Image.new("RGB", (24, 24), (0, 0, 255)).save(root / "00000005b.png")  # no caption file
    Image.new("RGB", (24, 24), (0, 255, 0)).save(root / "00000008a.png")
    (root / "00000008a.txt").write_text("   \n")
    sub = root / "sub"
    sub.mkdir()
    wide = Image.new("RGB", (40, 20), (0, 200, 0))  # red | green | blue stripes, wider than tall
    wide.paste((220, 0, 0), (0, 0, 10, 20))
    wide.paste((0, 0, 220), (30, 0, 40, 20))
    wide.save(sub / "wide.JPG", quality=95)
    (sub / "wide.txt").write_text("a wide image in a subfolder\n")
    return root


def test_folder_samples_have_contract_format_and_are_deterministic(clean_folder):
    a = take(FolderStream(clean_folder, R, seed=3, rank=0, world_size=1), 25)
    b = take(FolderStream(clean_folder, R, seed=3, rank=0, world_size=1), 25)
    assert_same(a, b)
    s = a[0]
    assert set(s) == {"image", "caption", "skipped", "data_cursor"}
    assert s["image"].shape == (3, R, R) and s["image"].dtype == torch.float32
    assert (
        -1 <= float(s["image"].min())
        and float(s["image"].max()) <= 1
        and float(s["image"].min()) < -0.5
    )
    assert isinstance(s["caption"], str) and s["skipped"] == 0
    # epoch 0 visits every image once, epoch 1 in a different order; another seed gives another
    # order
    assert len({x["caption"] for x in a[:10]}) == 10
    assert [x["caption"] for x in a[:10]] != [x["caption"] for x in a[10:20]]
    c = take(FolderStream(clean_folder, R, seed=4, rank=0, world_size=1), 10)
    assert [x["caption"] for x in c] != [x["caption"] for x in a[:10]]
    ordered = take(FolderStream(clean_folder, R, seed=3, rank=0, world_size=1, shuffle=False), 10)
    assert [x["caption"][:8] for x in ordered] == [f"{i:08d}" for i in range(10)]


@pytest.mark.parametrize("start", [1, 7, 13])
def test_folder_resume_is_exact_tail(dirty_folder, start):
    full = take(FolderStream(dirty_folder, R, seed=1, rank=1, world_size=2), 20)
    tail = take(
        FolderStream(dirty_folder, R, seed=1, rank=1, world_size=2, start=start), 20 - start
    )
    assert_same(full[start:], tail)
    assert sum(x["skipped"] for x in full) > 0  # the resumed part really crossed bad files


def test_folder_rank_split_is_disjoint_and_covers(clean_folder):
    seen = []
    for rank in range(3):
        per_epoch = len(range(rank, 10, 3))
        seen += [
            x["caption"]
            for x in take(FolderStream(clean_folder, R, seed=5, rank=rank, world_size=3), per_epoch)
        ]
    assert len(seen) == len(set(seen)) == 10


def test_folder_bad_files_are_skipped_counted_and_logged(dirty_folder, caplog):
    caplog.set_level(logging.WARNING, logger="unclip.train.data.sources")
    got = take(FolderStream(dirty_folder, R, seed=0, rank=0, world_size=1, shuffle=False), 12)
    assert [x["caption"][:8] for x in got[:10]] == [f"{i:08d}" for i in range(10)]
    assert got[10]["caption"] == "a wide image in a subfolder"  # recursive, upper-case extension
    assert [x["skipped"] for x in got] == [0, 0, 0, 1, 0, 0, 2, 0, 0, 1, 0, 0]
    text = caplog.text
    for reason in ("unreadable image", "missing caption", "empty caption", "00000005a.jpg"):
        assert reason in text


def test_folder_wide_image_is_resized_on_shorter_side_and_centre_cropped(dirty_folder):
    img = Image.open(dirty_folder / "sub" / "wide.JPG")
    x = image_to_tensor(img, R)
    assert x.shape == (3, R, R)
    centre = (x[:, :, 4:12] + 1) / 2 * 255  # green stripe only; red/blue stripes were cropped away
    assert (
        float(centre[1].mean()) > 170
        and float(centre[0].max()) < 60
        and float(centre[2].max()) < 60
    )


def test_folder_without_images_is_a_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text("caption without image")
    with pytest.raises(ValueError, match=str(tmp_path)) as err:
        FolderStream(tmp_path, R, seed=0, rank=0, world_size=1)
    assert "contains no images" in str(err.value) and "same-stem .txt captions" in str(err.value)
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        FolderStream(tmp_path / "missing", R, seed=0, rank=0, world_size=1)


def test_folder_reads_every_image_type_the_library_lists(tmp_path):
    Image.new("RGB", (R, R), (0, 0, 255)).save(tmp_path / "a.bmp")
    (tmp_path / "a.txt").write_text("a blue bitmap")
    (sample,) = take(FolderStream(tmp_path, R, seed=0, rank=0, world_size=1), 1)
    assert sample["caption"] == "a blue bitmap" and float(sample["image"][2].min()) == 1.0


def test_folder_all_bad_raises_instead_of_looping(tmp_path):
    (tmp_path / "a.png").write_bytes(b"nope")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="whole epoch"):
        take(FolderStream(tmp_path, R, seed=0, rank=0, world_size=1), 1)


# --------------------------------------------------------------------------------------------------
# WebDataset
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    paths = write_shapes(
        root,
        24,
        resolution=24,
        format="webdataset",
        shard_size=6,
        image_format="jpg",
        progress=False,
    )
    assert len(paths) == 4
    return root


def wds(url, **kw):
    kw = {"seed": 0, "rank": 0, "world_size": 1, "shuffle_buffer": 10, **kw}
    return WebDatasetStream(url, R, **kw)


def test_webdataset_is_deterministic_and_resumes_exactly(shards):
    url = str(shards / "{00000..00003}.tar")
    a = take(wds(url), 40)  # crosses into the second epoch
    assert_same(a, take(wds(url), 40))
    assert a[0]["image"].shape == (3, R, R) and a[0]["image"].dtype == torch.float32
    for start in (1, 13, 29):
        assert_same(a[start:], take(wds(url, start=start), 40 - start))
    other = take(wds(url, seed=1), 24)
    assert [sig(x) for x in other] != [sig(x) for x in a[:24]]


def test_webdataset_rank_and_worker_split_is_disjoint_and_covers(shards):
    url = str(shards / "{00000..00003}.tar")
    everything = {sig(x) for x in take(wds(url, shuffle_buffer=0), 24)}
    assert len(everything) == 24
    by_rank = [
        [sig(x) for x in take(wds(url, rank=r, world_size=2, shuffle_buffer=0), 12)]
        for r in range(2)
    ]
    assert (
        set(by_rank[0]).isdisjoint(by_rank[1]) and set(by_rank[0]) | set(by_rank[1]) == everything
    )
    parts = [
        [
            sig(x)
            for x in take(
                wds(url, rank=r, world_size=2, worker=w, num_workers=2, shuffle_buffer=0), 6
            )
        ]
        for r in range(2)
        for w in range(2)
    ]
    assert set().union(*parts) == everything and sum(map(len, parts)) == 24
    # rank 0's workers together hold rank 0's shards
    assert set(parts[0]) | set(parts[1]) == set(by_rank[0])


def test_webdataset_url_forms_agree(shards):
    files = [str(shards / f"{i:05d}.tar") for i in range(4)]
    ref = [sig(x) for x in take(wds(str(shards / "{00000..00003}.tar")), 30)]
    assert [sig(x) for x in take(wds(files), 30)] == ref
    assert [sig(x) for x in take(wds("::".join(files)), 30)] == ref
    assert [sig(x) for x in take(wds([f"pipe:cat {f}" for f in files]), 30)] == ref


def test_webdataset_fewer_shards_than_ranks_is_a_clear_error(shards):
    with pytest.raises(ValueError, match=r"4 shard.*world_size is 5.*[Rr]e-shard"):
        wds(str(shards / "{00000..00003}.tar"), rank=0, world_size=5)
    with pytest.raises(ValueError, match="fewer DataLoader workers"):
        take(
            wds(str(shards / "{00000..00003}.tar"), rank=1, world_size=2, worker=2, num_workers=3),
            1,
        )


def _add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def corrupt_shard(tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "bad.tar"
    good = jpeg_bytes(Image.new("RGB", (30, 20), (10, 120, 240)))
    with tarfile.open(path, "w") as tar:
        _add(tar, "k0.jpg", good), _add(tar, "k0.txt", b"good zero")
        _add(tar, "k1.jpg", b"\xff\xd8\xff garbage"), _add(tar, "k1.txt", b"garbage jpeg")
        _add(tar, "k2.jpg", good[: len(good) // 2]), _add(tar, "k2.txt", b"truncated jpeg")
        _add(tar, "k3.jpg", good), _add(tar, "k3.json", b"{}")  # no caption
        _add(tar, "k4.jpg", good), _add(tar, "k4.txt", b"good four")
        _add(tar, "k5.png", good), _add(tar, "k5.txt", b"  ")  # empty caption
        # wrong extension, still decodable
        _add(tar, "k6.webp", good), _add(tar, "k6.txt", b"good six")
        _add(tar, "k7.txt", b"caption without an image")
    return path


def test_webdataset_corrupt_members_are_skipped_and_counted(corrupt_shard, caplog):
    caplog.set_level(logging.WARNING, logger="unclip.train.data.sources")
    got = take(wds(str(corrupt_shard), shuffle_buffer=0), 4)
    assert [x["caption"] for x in got] == ["good zero", "good four", "good six", "good zero"]
    assert [x["skipped"] for x in got] == [0, 3, 1, 1]
    for reason in ("unreadable image", "missing caption", "empty caption", "no image member"):
        assert reason in caplog.text
    assert_same(got[1:], take(wds(str(corrupt_shard), shuffle_buffer=0, start=1), 3))


def _spoil_images(shard, out):
    """A copy of ``shard`` whose image bytes are garbage (same sizes and headers): a stream that
    decodes them skips every sample."""
    with tarfile.open(shard) as src, tarfile.open(out, "w") as dst:
        for member in src:
            data = src.extractfile(member).read()
            if not member.name.endswith(".txt"):
                data = b"\x00" * len(data)
            dst.addfile(member, io.BytesIO(data))


@pytest.mark.parametrize("shuffle_buffer", [0, 10])
def test_webdataset_resumes_at_a_cursor_without_reading_what_it_consumed(
    shards, corrupt_shard, tmp_path, shuffle_buffer
):
    """A stream resumed at a sample's ``data_cursor`` yields exactly what followed that sample, with
    bad samples counted as before; the shards it consumed are listed, not read: after they are
    spoiled (same headers, garbage images), the cursor resume is unchanged while a resume by
    sample count decodes them and goes astray."""
    urls = [str(shards / f"{i:05d}.tar") for i in range(4)] + [str(corrupt_shard)]
    copies = [str(tmp_path / f"{i}.tar") for i in range(5)]
    for url, copy in zip(urls, copies):
        (tmp_path / Path(copy).name).write_bytes(Path(url).read_bytes())
    a = take(wds(copies, shuffle_buffer=shuffle_buffer), 60)  # into the third epoch
    assert sum(x["skipped"] for x in a) > 0
    assert [x["data_cursor"][:2] for x in a] == [(0, 1)] * 60
    for k in (1, 9, 27, 44):
        assert_same(
            a[k:],
            take(
                wds(copies, shuffle_buffer=shuffle_buffer, cursor=a[k - 1]["data_cursor"][2]),
                60 - k,
            ),
        )
    if shuffle_buffer:
        return
    # without a shuffle buffer, the first epoch's first two shards are consumed by sample 20
    order = np.random.default_rng([0, 2, 0]).permutation(5)[:2]
    for i in order:
        _spoil_images(urls[i], copies[i])
    k = 20
    resumed = take(wds(copies, shuffle_buffer=0, cursor=a[k - 1]["data_cursor"][2]), 5)
    assert_same(a[k : k + 5], resumed)
    by_count = take(wds(copies, shuffle_buffer=0, start=k), 5)
    assert [x["caption"] for x in by_count] != [x["caption"] for x in a[k : k + 5]]


def test_shard_listing_counts_what_a_read_yields(shards, corrupt_shard, tmp_path):
    """The header-only listing of a shard has the samples (keys, order) and breaks of a full read,
    for a clean, a corrupt and a truncated shard; each listed sample reads back from its offset."""
    data = (shards / "00001.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 + 100])
    for url in (str(shards / "00000.tar"), str(corrupt_shard), str(tmp_path / "cut.tar")):
        read = list(iter_tar_samples([url]))
        listed = shard_listing(url)
        assert [x.get("__key__") for x in listed] == [x.get("__key__") for x in read], url
        assert ["__error__" in x for x in listed] == ["__error__" in x for x in read], url
        samples = [x for x in listed if "__error__" not in x]
        back = read_listed(samples)
        for x, raw in zip(samples, read):
            assert back[url, x["__index__"]] == raw
    assert any("__error__" in x for x in shard_listing(str(tmp_path / "cut.tar")))
    assert shard_listing(f"pipe:cat {shards / '00000.tar'}") is None


def test_folder_resumes_at_a_cursor_without_reading_what_it_consumed(dirty_folder, tmp_path):
    folder = tmp_path / "folder"
    for f in dirty_folder.rglob("*"):
        if f.is_file():
            target = folder / f.relative_to(dirty_folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())

    def stream(**kw):
        return FolderStream(folder, R, seed=1, rank=0, world_size=1, **kw)

    a = take(stream(), 30)
    for k in (1, 7, 23):
        assert_same(a[k:], take(stream(cursor=a[k - 1]["data_cursor"][2]), 30 - k))
    # the files read before sample 5 (the first epoch's first ones) are spoiled: a resume at the
    # cursor never opens them, a resume by count decodes them and goes astray
    k, files = 5, list_images(folder)
    cursor = a[k - 1]["data_cursor"][2]
    for i in np.random.default_rng([1, 0]).permutation(len(files))[:cursor]:
        files[i].write_bytes(b"spoiled")
    assert_same(a[k:10], take(stream(cursor=cursor), 10 - k))
    assert [x["caption"] for x in take(stream(start=k), 10 - k)] != [x["caption"] for x in a[k:10]]


def test_webdataset_truncated_shard_does_not_kill_the_stream(shards, tmp_path):
    data = (shards / "00000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 + 100])
    got = take(wds([str(tmp_path / "cut.tar"), str(shards / "00001.tar")], shuffle_buffer=0), 12)
    # all of the good shard plus what was readable of the cut one
    assert len({sig(x) for x in got}) >= 7


# --------------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    rng = np.random.default_rng(0)
    for sub in ("img_emb", "text_emb", "metadata"):
        (root / sub).mkdir()
    for i, n in enumerate((7, 5, 6)):
        img = rng.standard_normal((n, 8)).astype(np.float16)
        txt = rng.standard_normal((n, 8)).astype(np.float32)
        meta = [{"key": f"{i}-{j}", "caption": f"shard {i} row {j}"} for j in range(n)]
        if i == 1:
            img[2, 3] = np.nan
            txt[4, 0] = np.inf
        if i == 2:
            meta[1]["caption"] = ""
        np.save(root / "img_emb" / f"img_emb_{i}.npy", img)
        np.save(root / "text_emb" / f"text_emb_{i}.npy", txt)
        (root / "metadata" / f"metadata_{i}.jsonl").write_text(
            "".join(json.dumps(m) + "\n" for m in meta)
        )
    return root


def test_embeddings_one_epoch_reads_every_good_row_and_counts_bad_ones(emb_dir):
    got = take(EmbeddingStream(emb_dir, seed=0, rank=0, world_size=1), 15 + 1)
    s = got[0]
    assert set(s) == {"image_embed", "text_embed", "caption", "skipped", "data_cursor"}
    assert s["image_embed"].dtype == torch.float32 and s["image_embed"].shape == (8,)
    epoch = got[:15]
    assert len({x["caption"] for x in epoch}) == 15
    # the 3 bad rows of epoch 0 are counted on the sample after them (the 16th if they close the
    # epoch); the 16th may also count bad rows that open epoch 1
    assert sum(x["skipped"] for x in epoch) <= 3 <= sum(x["skipped"] for x in got) <= 6
    for x in epoch:  # values are the stored rows
        i, j = (int(v) for v in x["caption"].split()[1::2])
        img = np.load(emb_dir / "img_emb" / f"img_emb_{i}.npy")[j].astype(np.float32)
        assert np.array_equal(x["image_embed"].numpy(), img)
        txt = np.load(emb_dir / "text_emb" / f"text_emb_{i}.npy")[j]
        assert np.array_equal(x["text_embed"].numpy(), txt)
    assert {"shard 1 row 2", "shard 1 row 4", "shard 2 row 1"}.isdisjoint(
        {x["caption"] for x in epoch}
    )


def test_embeddings_deterministic_resume_and_rank_split(emb_dir):
    a = take(EmbeddingStream(emb_dir, seed=2, rank=0, world_size=1), 40)
    assert_same(a, take(EmbeddingStream(emb_dir, seed=2, rank=0, world_size=1), 40))
    assert sum(x["skipped"] for x in a) >= 6
    for start in (3, 15, 22):
        assert_same(
            a[start:],
            take(EmbeddingStream(emb_dir, seed=2, rank=0, world_size=1, start=start), 40 - start),
        )
    # ranks: one epoch is 18 rows in 3 shards, 3 of them bad; split positions r, r+3, ... of the
    # epoch order
    caps = []
    for r in range(3):
        stream = EmbeddingStream(emb_dir, seed=2, rank=r, world_size=3)
        caps.append([x["caption"] for x in take(stream, 6)])
    first_epoch = [set(c[:3]) for c in caps]  # at least 6 - 3 rows of each rank are from epoch 0
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(first_epoch, 2))


def test_embeddings_rank_union_is_one_epoch(tmp_path):
    for sub in ("img_emb", "text_emb", "metadata"):
        (tmp_path / sub).mkdir()
    for i, n in enumerate((5, 4)):
        x = np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 100 * i
        np.save(tmp_path / "img_emb" / f"img_emb_{i}.npy", x)
        np.save(tmp_path / "text_emb" / f"text_emb_{i}.npy", -x)
        (tmp_path / "metadata" / f"metadata_{i}.jsonl").write_text(
            "".join(json.dumps({"key": f"{i}{j}", "caption": f"{i}{j}"}) + "\n" for j in range(n))
        )
    seen = []
    for r in range(2):
        seen += [
            x["caption"]
            for x in take(
                EmbeddingStream(tmp_path, seed=9, rank=r, world_size=2), len(range(r, 9, 2))
            )
        ]
    assert sorted(seen) == sorted(f"{i}{j}" for i, n in enumerate((5, 4)) for j in range(n))


def test_embeddings_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unclip embed"):
        EmbeddingStream(tmp_path, seed=0, rank=0, world_size=1)


# --------------------------------------------------------------------------------------------------
# DataLoader
# --------------------------------------------------------------------------------------------------
def test_collate_stacks_lists_and_sums():
    samples = [
        {"image": torch.full((3, 2, 2), float(i)), "caption": f"c{i}", "skipped": i}
        for i in range(3)
    ]
    batch = collate(samples)
    assert batch["image"].shape == (3, 3, 2, 2) and torch.equal(
        batch["image"][2], samples[2]["image"]
    )
    assert batch["caption"] == ["c0", "c1", "c2"] and batch["skipped"] == 3


def loader(path, start, workers, batch_size):
    factory = functools.partial(FolderStream, path, R, seed=0, rank=0, world_size=1)
    ds = StreamDataset(factory, start=start, batch_size=batch_size)
    return torch.utils.data.DataLoader(
        ds, batch_size=batch_size, num_workers=workers, collate_fn=collate
    )


def test_stream_dataset_worker_plan():
    # 5 batches from logical workers 0,1,0,1,0
    ds = StreamDataset(lambda **kw: [], start=10, batch_size=2)
    # the next batch is due from logical worker 1, and a fresh DataLoader asks its worker 0 first
    assert [ds.worker_plan(w, 2) for w in range(2)] == [(1, 4), (0, 6)]
    assert ds.worker_plan(0, 1) == (0, 10)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        StreamDataset(lambda **kw: [], start=3, batch_size=2).worker_plan(0, 2)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_resume_is_exact_and_workers_are_disjoint(dirty_folder, clean_folder, workers):
    full = take(loader(dirty_folder, 0, workers, 2), 7)
    resumed = take(loader(dirty_folder, 6, workers, 2), 4)  # after 3 batches
    for x, y in zip(full[3:], resumed):
        assert (
            x["caption"] == y["caption"]
            and x["skipped"] == y["skipped"]
            and torch.equal(x["image"], y["image"])
        )
    one_epoch = [c for b in take(loader(clean_folder, 0, workers, 1), 10) for c in b["caption"]]
    assert len(set(one_epoch)) == 10  # each of the 10 images exactly once across the workers
    assert sum(b["skipped"] for b in full) > 0


def test_webdataset_takes_an_img2dataset_output_folder(shards, tmp_path):
    # img2dataset's output folder: shards, their *_stats.json, a parquet per shard and a stats.json
    folder = tmp_path / "img2dataset_out"
    folder.mkdir()
    for f in shards.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    for i in range(4):
        (folder / f"{i:05d}.parquet").write_bytes(b"PAR1 not a shard PAR1")
    (folder / "stats.json").write_text("{}")
    ref = [sig(x) for x in take(wds(str(shards / "{00000..00003}.tar")), 30)]
    stream = wds(folder)
    assert stream.urls == [str(folder / f"{i:05d}.tar") for i in range(4)]
    assert [sig(x) for x in take(stream, 30)] == ref and wds(str(folder)).urls == stream.urls
    with pytest.raises(ValueError, match=r"no \.tar shards in it.*img2dataset"):
        wds(tmp_path)
