"""Image conversions at the library's boundary: PIL/uint8/files in, tensors in [-1, 1] inside."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from unclip.utils.files import write_file


def pil_to_tensor(image) -> torch.Tensor:
    """PIL RGB image → float tensor ``[3, H, W]`` in [-1, 1]."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def save_image(image: Image.Image, path: str | os.PathLike, **options) -> Path:
    """Write ``image`` to ``path`` whole (:func:`~unclip.utils.files.write_file`): a full disk
    leaves no truncated file and its ``OSError`` names ``path``. The format comes from the
    suffix unless ``options`` give ``format``."""
    path = Path(path)
    fmt = options.pop("format", None) or Image.registered_extensions().get(path.suffix.lower())
    return write_file(path, lambda tmp: image.save(tmp, format=fmt, **options))


def open_image_file(path: str | os.PathLike, what: str = "image", mode: str = "RGB") -> Image.Image:
    r"""The image file ``path`` decoded to ``mode``. A missing file is a ``FileNotFoundError``; a
    folder, a file that is not an image and one past PIL's pixel limit against decompression
    bombs (a 400-megapixel image would take gigabytes) are one-line ``ValueError``\ s naming
    ``what`` and the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give an image file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        with Image.open(path) as im:
            return im.convert(mode)
    except Image.DecompressionBombError as exc:
        raise ValueError(
            f"{what} {path} is too large to open ({exc}); resize it to at most "
            f"{Image.MAX_IMAGE_PIXELS:,} pixels first"
        ) from None
    # PIL raises several types for broken data
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"cannot read {what} {path}: not an image file ({exc})") from None


def as_image_input(image):
    if isinstance(image, (str, os.PathLike)):
        return open_image_file(image)
    if isinstance(image, np.ndarray):
        return Image.fromarray(image.astype(np.uint8)).convert("RGB")
    return image


def to_output(images: torch.Tensor, output_type: str = "pil"):
    """``[N, 3, H, W]`` in [-1, 1] → as diffusers returns images: ``"pil"`` a list of PIL images,
    ``"np"`` a float32 array ``[N, H, W, 3]`` in [0, 1], ``"pt"`` a float tensor ``[N, 3, H, W]``
    in [0, 1], ``"latent"`` the tensor itself (in [-1, 1]); ``"uint8"``: an array ``[N, H, W, 3]``
    of 0–255 (the PIL images' pixels)."""
    if output_type == "latent":
        return images
    x = ((images.float().cpu() + 1) / 2).clamp(0, 1)
    if output_type == "pt":
        return x
    if output_type == "np":
        return x.permute(0, 2, 3, 1).numpy()
    arr = (x.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    return arr if output_type == "uint8" else [Image.fromarray(a) for a in arr]


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def list_images(folder: str | os.PathLike, what: str = "image folder") -> list[Path]:
    """Image files under ``folder`` (recursively, sorted by relative path).

    ``ValueError`` naming ``what`` if the folder is missing or holds no image."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{what} {root} does not exist or is not a directory")
    files = sorted(
        (p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise ValueError(f"{what} {root} contains no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files


def resize_crop_box(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """Shorter side to ``size``, then a centred ``size × size`` crop: ``(new_h, new_w, top, left)``.

    One geometry for every resize-and-crop (training images, CLIP inputs, evaluation images),
    whatever library does the interpolation."""
    s = size / min(height, width)
    nh, nw = max(size, round(height * s)), max(size, round(width * s))
    return nh, nw, (nh - size) // 2, (nw - size) // 2


def resize_crop_tensor(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[..., C, H, W]`` float → ``[..., C, size, size]``: bicubic antialiased resize of the
    shorter side, centre crop (values are not clamped)."""
    nh, nw, top, left = resize_crop_box(x.shape[-2], x.shape[-1], size)
    if (nh, nw) != tuple(x.shape[-2:]):
        flat = x.reshape(-1, *x.shape[-3:])
        flat = torch.nn.functional.interpolate(
            flat, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False
        )
        x = flat.reshape(*x.shape[:-2], nh, nw)
    return x[..., top : top + size, left : left + size]


def image_grid(images, cols: int | None = None, background: int = 255) -> Image.Image:
    """Tile equally sized images into one PIL grid of ``cols`` columns (default: a near-square
    layout), filling unused cells with ``background``.

    ``images``: PIL images, uint8 arrays ``[H, W, 3]``, or a float tensor ``[N, 3, H, W]`` in
    [-1, 1].
    """
    from torchvision.utils import make_grid

    if isinstance(images, torch.Tensor):
        batch = ((images.detach().float().cpu() + 1) / 2).clamp(0, 1)
    else:
        if len(images) == 0:
            raise ValueError("image_grid needs at least one image")
        arrays = [
            np.asarray(im.convert("RGB") if isinstance(im, Image.Image) else im) for im in images
        ]
        batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255
    if batch.shape[0] == 0:
        raise ValueError("image_grid needs at least one image")
    cols = cols or math.ceil(math.sqrt(batch.shape[0]))
    if batch.shape[0] < cols:  # make_grid would narrow the grid to the number of images
        fill = torch.full((cols - batch.shape[0], *batch.shape[1:]), background / 255)
        batch = torch.cat([batch, fill])
    grid = make_grid(batch, nrow=cols, padding=0, pad_value=background / 255)
    return Image.fromarray((grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
