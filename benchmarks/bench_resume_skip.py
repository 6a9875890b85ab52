"""Resuming a webdataset stream: the cost per resumed sample of skipping what a run already
consumed, three ways: by sample count (every earlier sample read and its image decoded, to know
which were bad), by cursor from an older checkpoint (the consumed shards listed by their tar
headers, nothing decoded), and by cursor with the shard counts a checkpoint now holds (the
consumed shards passed unopened, the shuffle buffer's content computed from its draws in bulk).

    python benchmarks/bench_resume_skip.py            # results/bench_resume_skip.json
    python benchmarks/bench_resume_skip.py --quick    # fewer samples, 1 round

img2dataset-like shards are written to a temporary folder: 256 px JPEGs (quality 90, photo-like
content: smooth colour fields with grain) with ``.txt`` captions. Each resume builds a new stream
at a sample and takes its first sample. The cost per resumed sample is the marginal one, (time to
resume at K2 - time to resume at K1) / (K2 - K1): what grows with a run's length (at LAION scale,
millions of samples), without the fixed cost of a resume (reading the shuffle buffer's samples and
into the shard where the cursor stands), which is reported too. By count and from an older
checkpoint K1, K2 = 25 % and 90 % of one epoch; with shard counts K2 lies many epochs on (the
stream loops over its shards), as its marginal cost is too small to see over one epoch. The
variants alternate within rounds (order reversed every other round) after an untimed warm-up
round; the ratio is the median of the per-round ratios.
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
from typing import Optional

import common
import numpy as np
from PIL import Image

from unclip.train.data.sources import WebDatasetStream
from unclip.train.data.tars import expand_urls, file_stamp, shard_listing


def write_shards(root: Path, shards: int, per_shard: int, size: int = 256) -> str:
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
    shards, per_shard, rounds, epochs = (4, 100, 1, 100) if args.quick else (8, 300, 7, 1000)
    buffer = 100
    with tempfile.TemporaryDirectory() as tmp:
        url = write_shards(Path(tmp), shards, per_shard)
        urls = expand_urls(url)
        total = shards * per_shard
        points = (int(total * 0.25), int(total * 0.9))
        deep = points[0] + epochs * total
        stream = WebDatasetStream(
            url, args.resolution, seed=0, rank=0, world_size=1, shuffle_buffer=buffer
        )
        seen = list(itertools.islice(iter(stream), points[1] + 1))
        cursors = {k: seen[k - 1]["data_cursor"][2] for k in points}
        cursors[deep] = deep  # no bad samples: a cursor counts samples
        # what the run's cursors would have carried: each shard's samples, size and mtime
        counts = {u: [len(shard_listing(u)), *file_stamp(u)] for u in urls}

        def resume(way: str, k: int) -> float:
            at = {
                "by_count": {"start": k},
                "by_cursor_listed": {"cursor": cursors[k]},
                "by_cursor": {"cursor": cursors[k], "shard_counts": counts},
            }[way]
            return first_sample(url, args.resolution, buffer, **at)

        runs = [(w, k) for w in ("by_count", "by_cursor_listed") for k in points]
        runs += [("by_cursor", points[0]), ("by_cursor", deep)]
        times: dict[str, list] = {f"{w}_{k}": [] for w, k in runs}
        times["fresh"] = []
        for r in range(rounds + 1):
            timed = {"fresh": first_sample(url, args.resolution, buffer)}
            for w, k in runs if r % 2 else runs[::-1]:
                timed[f"{w}_{k}"] = resume(w, k)
            if r:  # round 0 warms up
                for key, t in timed.items():
                    times[key].append(t)
        far = {"by_count": points[1], "by_cursor_listed": points[1], "by_cursor": deep}

        def per_sample(way: str, i: Optional[int] = None) -> float:
            pick = statistics.median if i is None else (lambda v: v[i])
            t1, t2 = pick(times[f"{way}_{points[0]}"]), pick(times[f"{way}_{far[way]}"])
            return (t2 - t1) / (far[way] - points[0])

        per = {w: per_sample(w) for w in far}
        med = {k: statistics.median(v) for k, v in times.items()}
        fixed = {w: med[f"{w}_{points[0]}"] - points[0] * per[w] for w in far}
        ratios = {
            w: statistics.median(
                per_sample("by_count", i) / max(per_sample(w, i), 1e-12) for i in range(rounds)
            )
            for w in ("by_cursor_listed", "by_cursor")
        }
        # the resumed streams must agree with each other and with the uninterrupted one
        for k in points:
            for w in far:
                at = {"by_count": {"start": k}, "by_cursor_listed": {"cursor": cursors[k]}}.get(
                    w, {"cursor": cursors[k], "shard_counts": counts}
                )
                resumed = WebDatasetStream(
                    url, args.resolution, seed=0, rank=0, world_size=1, shuffle_buffer=buffer, **at
                )
                assert next(iter(resumed))["caption"] == seen[k]["caption"], (w, k)
        # deep in the run: with counts as from an older checkpoint (listing every shard passed)
        mid = points[0] + 20 * total
        firsts = [
            next(
                iter(
                    WebDatasetStream(
                        url,
                        args.resolution,
                        seed=0,
                        rank=0,
                        world_size=1,
                        shuffle_buffer=buffer,
                        cursor=mid,
                        **kw,
                    )
                )
            )["caption"]
            for kw in ({}, {"shard_counts": counts})
        ]
        assert firsts[0] == firsts[1]
    result = {
        "machine": common.machine(),
        "setup": {
            "shards": shards,
            "samples_per_shard": per_shard,
            "image": "256 px JPEG, quality 90",
            "resolution": args.resolution,
            "shuffle_buffer": buffer,
            "resumed_at_samples": {w: [points[0], far[w]] for w in far},
            "rounds": rounds,
        },
        "seconds_to_first_sample": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "ms_per_resumed_sample": {k: round(v * 1e3, 6) for k, v in per.items()},
        "fixed_ms_per_resume": {k: round(v * 1e3, 2) for k, v in fixed.items()},
        "cheaper_by": {k: round(v, 1) for k, v in ratios.items()},
        "note": "marginal cost per resumed sample; the fixed cost per resume is reported apart; "
        "cheaper_by: median of per-round ratios of by_count's cost per sample to each way's",
    }
    print(common.machine_line(result["machine"]))
    at = result["setup"]["resumed_at_samples"]
    print(f"{shards} shards of {per_shard}, shuffle buffer {buffer}; resumed at {at}")
    for k, v in per.items():
        print(
            f"  {k:17s} {v * 1e3:10.6f} ms per resumed sample, {fixed[k] * 1e3:7.1f} ms per resume"
        )
    for k, v in ratios.items():
        print(f"  {k} is {v:.1f}x cheaper per sample than by_count")
    if not args.quick:
        print("wrote", common.write_json("bench_resume_skip", result))


if __name__ == "__main__":
    main()
