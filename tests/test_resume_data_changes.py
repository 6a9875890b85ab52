"""A resume whose data is not what the checkpoint's cursors were taken on is refused in one line
naming what changed and what to do, never trained on silently: the shard a worker was reading
rewritten (same sample count) or cut short of its cursor, the shard list changed, the number of
DataLoader workers changed. 8 webdataset shards of 6 samples, 2 workers, a shuffle buffer of 10,
a checkpoint after 5 batches (worker 0 then stands inside its fourth shard)."""

import io
import json
import os
import tarfile

import numpy as np
import pytest
from conftest import CONFIGS

from unclip.shapes.export import write_shapes
from unclip.train.config import DataConfig
from unclip.train.data.batching import cursors_of
from unclip.train.data.loader import make_batches
from unclip.train.state_files import data_cursors

SIZE, BUFFER, WORKERS, BATCH, STEPS = 6, 10, 2, 4, 5


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    write_shapes(
        root, 8 * SIZE, resolution=16, format="webdataset", shard_size=SIZE, progress=False
    )
    return root


@pytest.fixture
def shards(shard_files, tmp_path):
    for f in shard_files.glob("*.tar"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def config(folder, last=7, **kw):
    return DataConfig(
        **{
            "source": "webdataset",
            "path": str(folder / f"{{00000..{last:05d}}}.tar"),
            "batch_size": BATCH,
            "num_workers": WORKERS,
            "shuffle_buffer": BUFFER,
            **kw,
        }
    )


def loader(data, **kw):
    return iter(make_batches(data, resolution=16, seed=0, rank=0, world_size=1, **kw))


@pytest.fixture
def checkpoint(shards):
    """``(cursors as a checkpoint gives them back, the uninterrupted run's next 4 batches)``."""
    full, saved = loader(config(shards)), {}
    for _ in range(STEPS):
        cursors_of(next(full), saved)
    after = [next(full)["caption"] for _ in range(4)]
    return data_cursors(json.loads(json.dumps(saved))), after


def reading(folder, worker, position):
    """``(shard, samples of it the worker had read)``: where worker ``worker``'s reader stood
    when its stream had put out ``position`` samples (its buffer had taken ``BUFFER`` more)."""
    urls = sorted(str(p) for p in folder.glob("*.tar"))
    order = [urls[i] for i in np.random.default_rng([0, 2, 0]).permutation(len(urls))]
    taken = position + BUFFER
    return order[worker::WORKERS][(taken - 1) // SIZE], (taken - 1) % SIZE + 1


def resume(data, cursors):
    """The resumed loader's first batch of each worker."""
    batches = loader(data, start=STEPS * BATCH, cursors=cursors)
    return [next(batches)["caption"] for _ in range(WORKERS)]


def rewrite(url, keep):
    """Write the shard again with the samples ``keep`` picks (a list of sample lists in order)."""
    with tarfile.open(url) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    samples: dict = {}
    for m, data in members:
        samples.setdefault(m.name.split(".")[0], []).append((m, data))
    chosen = keep(list(samples.values()))
    with tarfile.open(url, "w") as tar:
        for sample in chosen:
            for m, data in sample:
                tar.addfile(m, io.BytesIO(data))


def test_an_unchanged_resume_goes_on_as_the_run(shards, checkpoint):
    cursors, after = checkpoint
    resumed = loader(config(shards), start=STEPS * BATCH, cursors=cursors)
    assert [next(resumed)["caption"] for _ in range(4)] == after


def test_the_shard_in_progress_rewritten_with_its_count_is_refused(shards, checkpoint):
    """Same samples in another order: same count, same size; only the stamp tells."""
    cursors, after = checkpoint
    url, read = reading(shards, 0, cursors["positions"][0])
    assert 0 < read < SIZE  # in progress
    size = os.path.getsize(url)
    rewrite(url, lambda samples: samples[::-1])
    assert os.path.getsize(url) == size
    with pytest.raises(ValueError, match="changed on disk since") as exc:
        resume(config(shards), cursors)
    message = str(exc.value)
    assert url in message and "restore the shard" in message and "\n" not in message


def test_the_shard_in_progress_cut_short_of_the_cursor_is_refused(shards, checkpoint):
    """The worker had read 4 of its 6 samples; the shard now has 3: its next shard must not stand
    in for the 4th."""
    cursors, _ = checkpoint
    url, read = reading(shards, 0, cursors["positions"][0])
    assert read == 4
    rewrite(url, lambda samples: samples[:3])
    with pytest.raises(ValueError, match="changed on disk since") as exc:
        resume(config(shards), cursors)
    assert url in str(exc.value) and "\n" not in str(exc.value)


def test_another_shard_list_is_refused(shards, checkpoint):
    """``{00000..00006}`` for ``{00000..00007}``: another permutation of the shards every epoch."""
    cursors, _ = checkpoint
    with pytest.raises(ValueError, match=r"shard list \(data.path\) changed") as exc:
        resume(config(shards, last=6), cursors)
    assert "8 shards then, 7 now" in str(exc.value) and "\n" not in str(exc.value)
    # the same number of shards, another order
    listed = [str(shards / f"{i:05d}.tar") for i in (1, 0, 2, 3, 4, 5, 6, 7)]
    with pytest.raises(ValueError, match="not in the same order"):
        resume(config(shards, path="::".join(listed)), cursors)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_another_number_of_workers_is_refused(shards, checkpoint, workers):
    """Each worker reads its own shards: with another number the parts differ, and a resume by
    sample count would train some samples twice and skip others."""
    cursors, _ = checkpoint
    with pytest.raises(ValueError, match=rf"resume with data.num_workers={WORKERS}") as exc:
        resume(config(shards, num_workers=workers), cursors)
    assert f"data.num_workers={workers}" in str(exc.value) and "\n" not in str(exc.value)


def in_buffer(worker, position):
    """The inputs worker ``worker``'s shuffle buffer holds after ``position`` outputs: it starts
    with inputs ``0 … BUFFER-1``, and each output's slot takes the next input."""
    rng = np.random.default_rng([0, 1, worker, WORKERS])
    slots = list(range(BUFFER))
    for j in range(position):
        slots[int(rng.integers(BUFFER))] = BUFFER + j
    return slots


def test_a_consumed_shard_with_samples_still_in_the_buffer_is_refused(shards, checkpoint):
    """A shard worker 0 had read to its end, rewritten: the buffer still held samples of it, which
    the resume reads again. (One whose samples had all left the buffer is only reported:
    ``test_resume_skip.py``.)"""
    cursors, _ = checkpoint
    held = {reading(shards, 0, i + 1 - BUFFER)[0] for i in in_buffer(0, cursors["positions"][0])}
    consumed = [reading(shards, 0, (k + 1) * SIZE - BUFFER)[0] for k in range(3)]
    kept = next(url for url in consumed if url in held)
    assert kept in cursors["shards"]
    rewrite(kept, lambda samples: samples[::-1])
    with pytest.raises(ValueError, match="still in the shuffle buffer") as exc:
        resume(config(shards), cursors)
    assert kept in str(exc.value)


def test_a_rewritten_shard_in_progress_stops_a_training_resume_in_one_line(tmp_path, capsys):
    """Through ``unclip train-decoder``: the run stops after 2 steps, the shard its worker was
    reading is rewritten, ``--resume latest`` is one line on stderr and trains nothing."""
    from unclip.cli import run_command

    write_shapes(tmp_path / "wds", 24, resolution=16, format="webdataset", shard_size=6)
    out = tmp_path / "run"
    run = [
        str(CONFIGS / "tiny" / "decoder.yaml"),
        "train.progress=false",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        f"train.output_dir={out}",
        "data.source=webdataset",
        f"data.path={tmp_path / 'wds' / '{00000..00003}.tar'}",
        "data.shuffle_buffer=4",
        "data.batch_size=4",
    ]
    assert run_command("train-decoder", [*run, "--max-steps-this-run", "2"]) == 0
    saved = json.loads((out / "checkpoints" / "step_00000002" / "data_0.json").read_text())
    url = saved["heads"]["0"][0]
    rewrite(url, lambda samples: samples[::-1])
    capsys.readouterr()
    assert run_command("train-decoder", [*run, "--resume", "latest"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and url in err[0] and "changed on disk since" in err[0]
    assert not (out / "checkpoints" / "step_00000004").exists()
