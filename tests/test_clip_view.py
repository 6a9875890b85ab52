"""``data.clip_view: full``: the decoder's CLIP image embedding is of the original image at the
CLIP's input size, not of the (smaller) training image; precomputed embeddings still win."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CONFIGS
from PIL import Image

from unclip.nets.clip import CLIP
from unclip.shapes.export import write_shapes
from unclip.shapes.world import ShapesWorld
from unclip.train.config import load_stage_config
from unclip.train.data.loader import ShapesStream
from unclip.train.data.sources import open_rgb
from unclip.train.data.tars import iter_tar_samples
from unclip.train.decoder import decoder_batches, decoder_image_embed
from unclip.utils.images import pil_to_tensor

ORIGINAL, TRAIN, CLIP_SIZE = 128, 32, 64
#: one original of the folder source is this wide (random pixels, so any other crop differs)
WIDE = 192


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip_view")
    write_shapes(root / "folder", 6, resolution=ORIGINAL, format="folder", progress=False)
    for txt in (root / "folder").glob("*.txt"):  # unique captions identify the samples
        txt.write_text(txt.stem)
    noise = np.random.default_rng(0).integers(0, 256, (ORIGINAL, WIDE, 3), dtype=np.uint8)
    Image.fromarray(noise).save(root / "folder" / "00000001.png")
    write_shapes(
        root / "wds", 6, resolution=ORIGINAL, format="webdataset", shard_size=6, progress=False
    )
    return root


def stage_config(source, root, view):
    path = root / "folder" if source == "folder" else root / "wds" / "00000.tar"
    return load_stage_config(
        CONFIGS / "tiny" / "decoder.yaml",
        [
            f"data.source={source}",
            f"data.path={path}",
            f"data.resolution={TRAIN}",
            f"decoder.sample_size={TRAIN}",
            "data.batch_size=6",  # the whole set: every original
            "data.shuffle_buffer=0",
            f"data.clip_view={view}",
            f"clip.model_cfg.vision_cfg.image_size={CLIP_SIZE}",
        ],
    )


def originals(source, root):
    """caption -> the original 128 px image as a [-1, 1] tensor."""
    if source == "folder":
        return {f.stem: pil_to_tensor(open_rgb(f)) for f in sorted((root / "folder").glob("*.png"))}
    out = {}
    for raw in iter_tar_samples([str(root / "wds" / "00000.tar")]):
        out[raw["txt"].decode()] = pil_to_tensor(open_rgb(raw["png"]))
    return out


def centre_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    """``image`` [3, H, W] in [-1, 1] with H the shorter side, at ``size`` px: H scaled to
    ``size`` (bicubic, antialiased), the middle ``size`` columns kept."""
    h, w = image.shape[-2:]
    assert h <= w and w * size % h == 0
    width = w * size // h
    x = F.interpolate(
        (image[None] + 1) / 2, size=(size, width), mode="bicubic", antialias=True
    ).clamp(0, 1)
    left = (width - size) // 2
    return x[0, :, :, left : left + size] * 2 - 1


@pytest.mark.parametrize("source", ["folder", "webdataset"])
def test_full_view_embeds_the_original_image(data, source):
    cfg = stage_config(source, data, "full")
    torch.manual_seed(0)
    clip = CLIP.from_config(cfg.clip)
    assert clip.image_size == CLIP_SIZE
    batch = next(iter(decoder_batches(cfg, clip, rank=0, world_size=1)))
    assert batch["image"].shape == (6, 3, TRAIN, TRAIN)
    assert batch["clip_image"].shape == (6, 3, CLIP_SIZE, CLIP_SIZE)
    got = decoder_image_embed(batch, clip, "cpu")
    full = originals(source, data)
    widths = [full[c].shape[-1] for c in batch["caption"]]
    assert all(full[c].shape[-2] == ORIGINAL for c in batch["caption"])
    assert sorted(widths) == [ORIGINAL] * 5 + ([WIDE] if source == "folder" else [ORIGINAL])
    crops = torch.stack([centre_crop(full[c], CLIP_SIZE) for c in batch["caption"]])
    want = clip.encode_image(crops)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if source == "folder":  # the wide original squeezed to a square instead is another embedding
        squeezed = F.interpolate(full["00000001"][None], size=(CLIP_SIZE, CLIP_SIZE))
        wide = batch["caption"].index("00000001")
        assert (clip.encode_image(squeezed)[0] - got[wide]).abs().max() > 100 * 1e-5
    # ... and not of the 32 px training image (the default view, data.clip_view: training_image)
    small = clip.encode_image(batch["image"])
    assert (got - small).abs().max() > 100 * 1e-5
    default = stage_config(source, data, "training_image")
    batch = next(iter(decoder_batches(default, clip, rank=0, world_size=1)))
    assert "clip_image" not in batch
    assert torch.allclose(decoder_image_embed(batch, clip, "cpu"), small)


def test_precomputed_embeddings_win():
    batch = {
        "image": torch.zeros(2, 3, 8, 8),
        "clip_image": torch.zeros(2, 3, 8, 8),
        "image_embed": torch.arange(8.0).view(2, 4),
    }
    assert torch.equal(decoder_image_embed(batch, None, "cpu"), batch["image_embed"])


def test_shapes_full_view_is_the_same_scene_at_clip_size():
    stream = ShapesStream(16, seed=3, clip_resolution=40)
    world = ShapesWorld(resolution=40, seed=3)
    for i, sample in enumerate(itertools.islice(stream, 3)):
        assert sample["image"].shape[-1] == 16
        assert torch.equal(sample["clip_image"], pil_to_tensor(world[i].image))
        assert sample["caption"] == world[i].caption
