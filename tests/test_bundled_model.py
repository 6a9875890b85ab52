"""The bundled shapes model (unclip/models/shapes): loads offline with no arguments, runs in fp32 on the
CPU, generates at its stated resolution, and gets the color, size and background of simple prompts
right (scored by the pixel evaluator) with the default sampling settings."""
import json

import pytest
import torch

from unclip import UnCLIPPipeline
from unclip.data.shapes import parse_caption
from unclip.data.shapes_eval import score
from unclip.pipeline import PIPELINE_FILE, bundled_model_path

RESOLUTION = 128


@pytest.fixture(scope="module")
def pipe():
    return UnCLIPPipeline.from_pretrained()


def test_bundled_folder_is_small_safetensors_only():
    root = bundled_model_path("shapes")
    files = [f for f in root.rglob("*") if f.is_file()]
    assert not [f for f in files if f.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    assert sum(f.stat().st_size for f in files) < 30e6
    index = json.loads((root / PIPELINE_FILE).read_text())
    assert index["components"]["upsamplers"] == ["sr64", "sr128"]


def test_default_model_loads_in_fp32_and_generates_at_its_resolution(pipe):
    assert pipe.stage_names == ["prior", "decoder", "sr64", "sr128"]
    assert pipe.resolution == RESOLUTION
    for name, module in pipe.modules().items():  # weights are stored in fp16 and upcast on load
        assert {p.dtype for p in module.parameters()} == {torch.float32}, name
    few = {"prior": {"steps": 5}, "decoder": {"steps": 8}, "upsamplers": {"steps": 3}}
    out = pipe(["a small red circle on the left", "a blue square above a green triangle"], sampling=few,
               generator=[torch.Generator().manual_seed(s) for s in (0, 1)], output_type="np", progress=False)
    assert out.images.shape == (2, RESOLUTION, RESOLUTION, 3)
    assert out.images.dtype.name == "uint8" and out.images.std() > 10  # not a blank image


@pytest.mark.parametrize("prompt", ["a small red circle on the left",
                                    "a big purple circle in the center on a gray background"])
def test_simple_prompt_color_size_background_right_with_default_settings(pipe, prompt):
    # What holds robustly for the shipped model (docs/shapes_model.md): color and size (and a named
    # background) of single-object prompts. Position and shape are not yet reliable enough to assert.
    seeds = (0, 1, 2)
    out = pipe([prompt] * len(seeds), generator=[torch.Generator().manual_seed(s) for s in seeds],
               output_type="np", progress=False)
    assert out.images.shape == (len(seeds), RESOLUTION, RESOLUTION, 3)
    expected = parse_caption(prompt)
    for seed, image in zip(seeds, out.images):
        result = score(image, expected)
        assert result["color"] and result["size"], (seed, result)
        assert result.get("background", True), (seed, result)
