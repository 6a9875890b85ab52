"""Writing the shapes world to disk (:func:`write_shapes`): a folder of images, captions and truth
files, or img2dataset-style webdataset shards (layouts in :mod:`unclip.shapes.world`'s doc). Each
file is written to a temporary name and renamed, so an interrupted export leaves no half files.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

from PIL import Image

from unclip.shapes.world import ShapesWorld


def _encode(image: Image.Image, image_format: str) -> bytes:
    buf = io.BytesIO()
    if image_format == "png":
        image.save(buf, format="PNG")
    else:
        image.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shapes(
    out_dir,
    num_samples: int,
    *,
    resolution: int = 64,
    seed: int = 0,
    split: str = "train",
    format: str = "folder",
    shard_size: int = 1000,
    start_index: int = 0,
    image_format: str = "png",
    two_object_prob: float = 0.3,
    background_phrase_prob: float = 0.5,
    progress: bool = True,
    extra_colors=None,
) -> list[Path]:
    """Write samples ``start_index .. start_index + num_samples - 1`` of a :class:`ShapesWorld`.

    ``format="folder"``: ``{index:08d}.{png|jpg,txt,json}`` in ``out_dir``. ``format="webdataset"``:
    ``{shard:05d}.tar`` shards of ``shard_size`` samples (keys ``{index:08d}``; the shard number is
    ``start_index // shard_size + i``, so ``start_index`` must be a multiple of ``shard_size``) and
    ``{shard:05d}_stats.json``. Every file is written to a temporary name and renamed.
    Returns the image paths (folder) or the shard paths (webdataset). ``extra_colors``: see
    :class:`ShapesWorld`.
    """
    from tqdm.auto import tqdm

    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if format not in ("folder", "webdataset"):
        raise ValueError(f"format must be 'folder' or 'webdataset', got {format!r}")
    if image_format not in ("png", "jpg"):
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be an int >= 1, got {shard_size!r}")
    if not isinstance(start_index, int) or start_index < 0:
        raise ValueError(f"start_index must be an int >= 0, got {start_index!r}")
    if format == "webdataset" and start_index % shard_size:
        raise ValueError(
            f"start_index ({start_index}) must be a multiple of shard_size ({shard_size}) "
            "so that shard numbers do not collide"
        )
    world = ShapesWorld(
        resolution, seed, split, two_object_prob, background_phrase_prob, extra_colors
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    bar = tqdm(total=num_samples, desc=f"shapes {split}", unit="img", disable=not progress)
    if format == "folder":
        for index in range(start_index, start_index + num_samples):
            s = world[index]
            stem = out / f"{index:08d}"
            _atomic_write(stem.with_suffix(".json"), json.dumps(s.truth).encode())
            _atomic_write(stem.with_suffix(".txt"), s.caption.encode())
            image_path = stem.with_suffix(f".{image_format}")
            _atomic_write(image_path, _encode(s.image, image_format))
            written.append(image_path)
            bar.update(1)
        bar.close()
        return written
    end = start_index + num_samples
    for shard_start in range(start_index, end, shard_size):
        shard = shard_start // shard_size
        path = out / f"{shard:05d}.tar"
        tmp = path.with_name(path.name + ".tmp")
        t0 = time.time()
        count = 0
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(shard_start, min(shard_start + shard_size, end)):
                s = world[index]
                key = f"{index:08d}"
                meta = {
                    "key": key,
                    "caption": s.caption,
                    "truth": s.truth,
                    "index": index,
                    "seed": seed,
                    "split": split,
                    "status": "success",
                    "error_message": None,
                    "width": resolution,
                    "height": resolution,
                }
                _tar_add(tar, f"{key}.{image_format}", _encode(s.image, image_format))
                _tar_add(tar, f"{key}.txt", s.caption.encode())
                _tar_add(tar, f"{key}.json", json.dumps(meta).encode())
                count += 1
                bar.update(1)
        os.replace(tmp, path)
        t1 = time.time()
        stats = {
            "count": count,
            "successes": count,
            "failed_to_download": 0,
            "failed_to_resize": 0,
            "duration": t1 - t0,
            "start_time": t0,
            "end_time": t1,
            "status_dict": {"success": count},
            "shapes": {
                "seed": seed,
                "split": split,
                "resolution": resolution,
                "start_index": shard_start,
            },
        }
        _atomic_write(out / f"{shard:05d}_stats.json", json.dumps(stats, indent=2).encode())
        written.append(path)
    bar.close()
    return written
