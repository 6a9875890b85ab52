"""A webdataset stream resumed at its cursor with the shard counts its cursors carried passes the
shards it consumed without opening them, replays its shuffle buffer from the buffer's draws alone,
and yields exactly what an uninterrupted stream yields; without counts (older checkpoints) it lists
the consumed shards; a shard changed since it was counted is reported."""

import io
import itertools
import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from unclip.shapes.export import write_shapes
from unclip.train.config import DataConfig
from unclip.train.data.batching import collate, cursors_of
from unclip.train.data.loader import make_batches
from unclip.train.data.resume import buffer_positions, fetch_samples
from unclip.train.data.sources import WebDatasetStream
from unclip.train.state_files import data_cursors

R = 16


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    """6 shards of 5 samples, and one cut short (its samples then a break)."""
    root = tmp_path_factory.mktemp("wds")
    paths = write_shapes(root, 30, resolution=16, format="webdataset", shard_size=5, progress=False)
    data = Path(paths[0]).read_bytes()
    (root / "cut.tar").write_bytes(data[: len(data) // 2 + 100])
    return [str(p) for p in paths] + [str(root / "cut.tar")]


@pytest.fixture
def copies(shard_files, tmp_path):
    out = []
    for url in shard_files:
        out.append(str(tmp_path / Path(url).name))
        Path(out[-1]).write_bytes(Path(url).read_bytes())
    return out


def stream(urls, **kw):
    return WebDatasetStream(urls, R, **{"seed": 0, "rank": 0, "world_size": 1, **kw})


def take(s, n):
    return list(itertools.islice(iter(s), n))


def ids(samples):
    return [(x["caption"], round(float(x["image"].double().sum()), 3)) for x in samples]


def counts(samples):
    """The shard counts a run's checkpoint holds after these samples."""
    known: dict = {}
    for x in samples:
        cursors_of({"data_cursor": x["data_cursor"]}, known)
    return known.get("shards", {})


def order(urls, epoch=0):
    return [urls[i] for i in np.random.default_rng([0, 2, epoch]).permutation(len(urls))]


def test_buffer_positions_are_those_of_a_buffer_run_item_by_item():
    for size, outputs, chunk in ((10, 0, 4), (10, 57, 7), (100, 3000, 333)):
        a, b = np.random.default_rng([0, 1, 0, 1]), np.random.default_rng([0, 1, 0, 1])
        buf = list(range(size))
        for j in range(outputs):
            buf[int(a.integers(size))] = size + j
        assert buffer_positions(b, size, outputs, chunk).tolist() == buf
        assert a.integers(1 << 40) == b.integers(1 << 40)  # the generator advanced alike


@pytest.mark.parametrize("shuffle_buffer", [0, 4, 10])
def test_a_resume_with_shard_counts_is_exact(copies, shuffle_buffer):
    a = take(stream(copies, shuffle_buffer=shuffle_buffer), 80)  # into the third epoch
    assert sum(x["skipped"] for x in a) > 0  # the cut shard's break went through the stream
    for k in (1, 4, 5, 17, 33, 61):
        cursor = a[k - 1]["data_cursor"][2]
        at = {"cursor": cursor, "shard_counts": counts(a[:k])}
        assert ids(take(stream(copies, shuffle_buffer=shuffle_buffer, **at), 80 - k)) == ids(a[k:])


def _spoil(url):
    """Zero a shard in place, keeping its size and modification time: only a stream that opens it
    notices."""
    st = os.stat(url)
    Path(url).write_bytes(b"\0" * st.st_size)
    os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_consumed_shards_are_passed_unopened(copies):
    """Without a shuffle buffer, sample 12 is the third shard's second: the two shards before it
    are spoiled. A resume with the counts yields what the uninterrupted stream yields; one without
    (an older checkpoint) lists the spoiled shards and goes astray."""
    a = take(stream(copies, shuffle_buffer=0), 20)
    k = 12
    cursor, known = a[k - 1]["data_cursor"][2], counts(a[:k])
    first = order(copies)[:2]
    assert [known[u][0] for u in first] == [5, 5]
    # a shard is counted by the time its last sample leaves the stream
    assert a[9]["data_cursor"][2] == 10 and set(counts(a[:10])) == set(first)
    for url in first:
        _spoil(url)
    resumed = take(stream(copies, shuffle_buffer=0, cursor=cursor, shard_counts=known), 20 - k)
    assert ids(resumed) == ids(a[k:])
    old = take(stream(copies, shuffle_buffer=0, cursor=cursor), 20 - k)
    assert ids(old) != ids(a[k:])


def test_an_older_checkpoint_lists_the_consumed_shards_and_carries_their_counts(copies):
    a = take(stream(copies, shuffle_buffer=4), 30)
    k = 17
    resumed = take(stream(copies, shuffle_buffer=4, cursor=a[k - 1]["data_cursor"][2]), 30 - k)
    assert ids(resumed) == ids(a[k:])
    # the shards it listed are counted as the uninterrupted stream counted them
    learnt, known = resumed[0]["data_cursor"][3], counts(a)
    assert learnt and all(known[u] == v for u, v in learnt.items())


def test_pipe_shards_before_the_cursor_are_not_read(copies):
    pipes = [f"pipe:cat {u}" for u in copies]
    a = take(stream(pipes, shuffle_buffer=4), 40)
    for k in (3, 19, 38):
        at = {"cursor": a[k - 1]["data_cursor"][2], "shard_counts": counts(a[:k])}
        assert ids(take(stream(pipes, shuffle_buffer=4, **at), 40 - k)) == ids(a[k:])
    # one shard: the buffer holds samples of its previous epoch beyond the cursor's index
    one = take(stream(pipes[:1], shuffle_buffer=4), 24)
    for k in (7, 13, 22):
        at = {"cursor": one[k - 1]["data_cursor"][2], "shard_counts": counts(one[:k])}
        assert ids(take(stream(pipes[:1], shuffle_buffer=4, **at), 24 - k)) == ids(one[k:])
    b = take(stream(pipes, shuffle_buffer=0), 20)
    at = {"cursor": b[11]["data_cursor"][2], "shard_counts": counts(b[:12])}
    for url in order(copies)[:2]:
        os.remove(url)  # reading it now would break the stream
    assert ids(take(stream(pipes, shuffle_buffer=0, **at), 8)) == ids(b[12:])


def _drop_last_sample(url):
    with tarfile.open(url) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    last = members[-1][0].name.split(".")[0]
    with tarfile.open(url, "w") as tar:
        for m, data in members:
            if m.name.split(".")[0] != last:
                tar.addfile(m, io.BytesIO(data))


def standing(urls, known, cursor):
    """``(shard, index)``: where a cursor stands, from the counts of the shards before it."""
    end = 0
    for epoch in itertools.count():
        for url in order(urls, epoch):
            if url not in known or end + known[url][0] > cursor:
                return url, cursor - end
            end += known[url][0]


def test_a_shard_changed_since_it_was_counted_is_reported(copies, caplog):
    """A consumed shard rewritten with a sample fewer: the resume warns and still skips what the run
    consumed. The shard the cursor stands in (counted in the first epoch) cut short: the resume
    cannot go on, and says why."""
    a = take(stream(copies, shuffle_buffer=0), 50)  # in the second epoch (35 raw items each)
    known = counts(a)
    first = order(copies, 1)[0]

    def inside(k):  # the cursor after sample k stands inside a shard, not the epoch's first
        url, index = standing(copies, known, a[k - 1]["data_cursor"][2])
        return index > 0 and url != first

    k = next(k for k in range(40, 50) if inside(k))
    cursor = a[k - 1]["data_cursor"][2]
    at = {"cursor": cursor, "shard_counts": counts(a[:k])}
    current = standing(copies, known, cursor)[0]
    _drop_last_sample(first)
    caplog.set_level(logging.WARNING, logger="unclip.train.data.sources")
    assert ids(take(stream(copies, shuffle_buffer=0, **at), 50 - k)) == ids(a[k:])
    assert "1 consumed shard(s) differ" in caplog.text and first in caplog.text
    Path(current).write_bytes(Path(current).read_bytes()[:1024] + b"\0" * 1024)
    with pytest.raises(ValueError, match=r"changed on disk since the checkpoint.*restore"):
        take(stream(copies, shuffle_buffer=0, **at), 1)
    with pytest.raises(ValueError, match=r"changed on disk since the checkpoint"):
        fetch_samples(first, [4])


def test_batches_carry_shard_counts_into_the_saved_cursor():
    news = [{"a.tar": [5, 10, 1]}, {}, {"b.tar": [3, 7, 2]}]
    batch = collate([{"data_cursor": (0, 2, p, n)} for p, n in zip((4, 5, 6), news)])
    assert batch["data_cursor"] == (0, 2, 6, {"a.tar": [5, 10, 1], "b.tar": [3, 7, 2]})
    known: dict = {}
    cursors_of(batch, known)
    cursors_of({"data_cursor": (1, 2, 3, {"c.tar": [1, 2, 3]})}, known)
    assert known["positions"] == {0: 6, 1: 3} and set(known["shards"]) == {
        "a.tar",
        "b.tar",
        "c.tar",
    }
    cursors_of({"data_cursor": (0, 1, 9, {})}, known)  # another number of workers: counts stay
    assert known["positions"] == {0: 9} and len(known["shards"]) == 3


@pytest.mark.parametrize("num_workers", [0, 1])
def test_training_batches_resume_exactly_from_saved_cursors_with_or_without_counts(
    copies, num_workers
):
    """The loader's batches after 3, resumed from the cursors a run saves, are those of the
    uninterrupted loader; with the shard counts saved, also once the shards consumed before the
    cursor are spoiled (not opened), and from an older checkpoint without counts (listed)."""
    data = DataConfig(
        source="webdataset",
        path="::".join(copies),
        batch_size=4,
        num_workers=num_workers,
        shuffle_buffer=0,
    )

    def loader(**kw):
        return iter(make_batches(data, resolution=R, seed=0, rank=0, world_size=1, **kw))

    full, saved = loader(), {}
    for _ in range(3):
        cursors_of(next(full), saved)
    after = [next(full)["caption"] for _ in range(4)]
    older = {k: v for k, v in saved.items() if k != "shards"}
    resumed = loader(start=12, cursors=older)
    assert [next(resumed)["caption"] for _ in range(4)] == after
    current = standing(copies, saved["shards"], saved["positions"][0])[0]
    consumed = order(copies)[: order(copies).index(current)]
    assert consumed and all(u in saved["shards"] for u in consumed)
    for url in consumed:
        _spoil(url)
    resumed = loader(start=12, cursors=saved)
    assert [next(resumed)["caption"] for _ in range(4)] == after


def test_a_checkpoint_gives_back_the_shard_counts_it_saved():
    saved = {"num_workers": 2, "positions": {"0": 8, "1": 4}, "shards": {"a.tar": [5, 10, 1]}}
    assert data_cursors(saved) == {
        "num_workers": 2,
        "positions": {0: 8, 1: 4},
        "shards": {"a.tar": [5, 10, 1]},
    }
    older = {"num_workers": 1, "positions": {"0": 8}}  # written before the counts
    assert data_cursors(older) == {"num_workers": 1, "positions": {0: 8}}
    assert data_cursors({}) == {}
