"""Resuming a webdataset stream: the cost per resumed sample of skipping what a run already
consumed, by sample count (every earlier sample read and its image decoded, to know which were bad)
against by cursor (the consumed shards listed by their tar headers, the shuffle buffer's samples
read, nothing decoded).

    python benchmarks/bench_resume_skip.py            # results/bench_resume_skip.json
    python benchmarks/bench_resume_skip.py --quick    # fewer samples, 1 round

img2dataset-like shards are written to a temporary folder: 256 px JPEGs (quality 90, photo-like
content: smooth colour fields with grain) with ``.txt`` captions. A stream with a shuffle buffer is
read past sample ``K2``; each resume builds a new stream at sample ``K1`` or ``K2`` and takes its
first sample. The cost per resumed sample is the marginal one, (time to resume at K2 - time to
resume at K1) / (K2 - K1): what grows with a run's length (at LAION scale, millions of samples),
without the fixed cost of a resume (refilling the shuffle buffer, reading into the shard where the
cursor stands), which is reported too. The variants alternate within rounds; medians over rounds.
"""

from __future__ import annotations

import argparse
import io
import itertools
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import common
import numpy as np
from PIL import Image

from unclip.train.data.sources import WebDatasetStream


def write_shards(root: Path, shards: int, per_shard: int, size: int) -> str:
    rng = np.random.default_rng(0)
    for s in range(shards):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                base = rng.uniform(0, 255, (4, 4, 3)).astype(np.uint8)
                img = Image.fromarray(base).resize((size, size), Image.BICUBIC)
                grain = rng.normal(0, 12, (size, size, 3))
                arr = np.clip(np.asarray(img, dtype=np.float64) + grain, 0, 255).astype(np.uint8)
                buf = io.BytesIO()
                Image.fromarray(arr).save(buf, format="JPEG", quality=90)
                key = f"{s:05d}{i:04d}"
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"sample {key}".encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(root / f"{{00000..{shards - 1:05d}}}.tar")


def first_sample(url: str, resolution: int, buffer: int, **at) -> float:
    t0 = time.perf_counter()
    stream = WebDatasetStream(
        url, resolution, seed=0, rank=0, world_size=1, shuffle_buffer=buffer, **at
    )
    next(iter(stream))
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--resolution", type=int, default=64, help="training resolution (decoder: 64)")
    args = ap.parse_args(argv)
    shards, per_shard, rounds = (4, 100, 1) if args.quick else (8, 300, 3)
    buffer = 100
    with tempfile.TemporaryDirectory() as tmp:
        url = write_shards(Path(tmp), shards, per_shard, 256)
        total = shards * per_shard
        points = (int(total * 0.25), int(total * 0.9))
        stream = WebDatasetStream(
            url, args.resolution, seed=0, rank=0, world_size=1, shuffle_buffer=buffer
        )
        seen = list(itertools.islice(iter(stream), points[1] + 1))
        cursors = [seen[k - 1]["data_cursor"][2] for k in points]
        times = {f"{way}_{k}": [] for way in ("by_count", "by_cursor") for k in points}
        times["fresh"] = []
        for _ in range(rounds):
            times["fresh"].append(first_sample(url, args.resolution, buffer))
            for k, cursor in zip(points, cursors):
                times[f"by_count_{k}"].append(first_sample(url, args.resolution, buffer, start=k))
                times[f"by_cursor_{k}"].append(
                    first_sample(url, args.resolution, buffer, cursor=cursor)
                )
        med = {k: statistics.median(v) for k, v in times.items()}
        per = {
            way: (med[f"{way}_{points[1]}"] - med[f"{way}_{points[0]}"]) / (points[1] - points[0])
            for way in ("by_count", "by_cursor")
        }
        fixed = {way: med[f"{way}_{points[0]}"] - points[0] * per[way] for way in per}
        # the resumed streams must agree with each other and with the uninterrupted one
        for k, cursor in zip(points, cursors):
            for at in ({"start": k}, {"cursor": cursor}):
                resumed = WebDatasetStream(
                    url, args.resolution, seed=0, rank=0, world_size=1, shuffle_buffer=buffer, **at
                )
                assert next(iter(resumed))["caption"] == seen[k]["caption"], at
    result = {
        "machine": common.machine(),
        "setup": {
            "shards": shards,
            "samples_per_shard": per_shard,
            "image": "256 px JPEG, quality 90",
            "resolution": args.resolution,
            "shuffle_buffer": buffer,
            "resumed_at_samples": list(points),
            "rounds": rounds,
        },
        "seconds_to_first_sample": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "ms_per_resumed_sample": {k: round(v * 1e3, 5) for k, v in per.items()},
        "fixed_ms_per_resume": {k: round(v * 1e3, 2) for k, v in fixed.items()},
        "cheaper_by": round(per["by_count"] / max(per["by_cursor"], 1e-12), 1),
        "note": "marginal cost per resumed sample; the fixed cost per resume is reported apart",
    }
    print(common.machine_line(result["machine"]))
    print(f"resumed at samples {points} of {total} ({shards} shards, shuffle buffer {buffer})")
    for k, v in per.items():
        print(
            f"  {k:10s} {v * 1e3:9.4f} ms per resumed sample, {fixed[k] * 1e3:7.1f} ms per resume"
        )
    print(f"  by cursor is {result['cheaper_by']}x cheaper")
    if not args.quick:
        print("wrote", common.write_json("bench_resume_skip", result))


if __name__ == "__main__":
    main()
