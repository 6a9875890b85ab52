"""`unclip evaluate`'s inputs: images in modes other than 8-bit RGB are read at their own depth or
refused in one line naming the file (16-bit grey PNGs were clipped to nearly white and scored), and
caption files that are empty or not UTF-8 are refused (an empty one was scored against "")."""

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from unclip.cli import run_command
from unclip.eval import metrics as M
from unclip.shapes.export import write_shapes


def _png16(path, grey: np.ndarray):
    """A 16-bit grey PNG of ``grey`` (uint16 ``[H, W]``), written byte by byte as PNG files from
    scientific cameras and image tools are."""
    h, w = grey.shape
    raw = b"".join(b"\x00" + grey[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", w, h, 16, 0, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


def test_a_16_bit_grey_png_reads_as_its_8_bit_twin(tmp_path):
    grey8 = np.random.default_rng(0).integers(0, 256, (16, 16)).astype(np.uint8)
    Image.fromarray(grey8).save(tmp_path / "g8.png")
    g16 = _png16(tmp_path / "g16.png", grey8.astype(np.uint16) * 257)
    assert Image.open(g16).mode.startswith("I")  # what PIL's convert("RGB") clipped
    a, b = M.read_image(g16, 16), M.read_image(tmp_path / "g8.png", 16)
    assert a is not None and b is not None and np.array_equal(a, b)


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("alpha.png", lambda: Image.new("RGBA", (8, 8), (255, 0, 0, 0)), "transparent pixels"),
        ("float.tif", lambda: Image.fromarray(np.ones((8, 8), np.float32)), "floating-point"),
        ("int32.tif", lambda: Image.fromarray(np.ones((8, 8), np.int32) * 70000), "32-bit"),
    ],
)
def test_images_that_cannot_be_read_faithfully_are_refused(tmp_path, name, make, message):
    path = tmp_path / name
    make().save(path)
    with pytest.raises(ValueError) as err:
        M.read_image(path, 8)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    opaque = tmp_path / "opaque.png"  # an alpha channel every pixel of which is opaque is fine
    Image.new("RGBA", (8, 8), (255, 0, 0, 255)).save(opaque)
    assert M.read_image(opaque, 8)[0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize(("content", "message"), [(b" \n", "is empty"), (b"\xff\xfe", "UTF-8")])
def test_a_sample_caption_that_is_empty_or_not_utf8_is_one_line(tmp_path, capsys, content, message):
    samples = tmp_path / "s"
    write_shapes(samples, 3, resolution=32, seed=0, split="heldout", progress=False)
    bad = sorted(samples.glob("*.txt"))[1]
    bad.write_bytes(content)
    argv = ["--samples", str(samples), "--inception", "random", "--inception-feature", "64"]
    argv += ["--reference", str(samples), "--no-progress", "--device", "cpu"]
    assert run_command("evaluate", [*argv, "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("unclip evaluate: error: caption file ") and str(bad) in err
    assert message in err
    assert not (tmp_path / "o" / "report.json").exists()
