"""The web demo's handlers (unclip.demo.handlers) on a tiny pipeline, its sampling form, and
`unclip serve`'s command line; the page itself is tested in a browser in test_demo_browser.py."""

import os
import sys

import numpy as np
import pytest
from conftest import token_pipeline
from PIL import Image

from unclip import cli

# CI installs the demo extra (README test command) and sets this: there a missing gradio fails
REQUIRED = bool(os.environ.get("UNCLIP_REQUIRE_BROWSER"))
try:
    import gradio as gr

    from unclip.demo import handlers as h
    from unclip.demo.app import SamplingForm, build_demo
except ImportError:
    if REQUIRED:
        raise
    gr = None
needs_gradio = pytest.mark.skipif(gr is None, reason="gradio is not installed (unclip[demo])")

# few steps: the handlers' wiring is under test, not the images
FEW = {"prior": {"steps": 2}, "decoder": {"steps": 2}, "upsampler": {"steps": 2}}


def picture(size=64, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


class Recorder:
    """A stand-in for gr.Progress: what the handler reported."""

    def __init__(self):
        self.calls = []

    def __call__(self, fraction, desc=None):
        self.calls.append((fraction, desc))


@needs_gradio
def test_generate_images_seed_and_progress(tiny_pipe, one_thread):
    progress = Recorder()
    images = h.generate(tiny_pipe, "a red circle", "", 3, 5, FEW, progress)
    assert len(images) == 3
    assert all(im.size == (tiny_pipe.resolution,) * 2 for im in images)
    # every denoising step of every stage moved the bar, which ends full
    stages = ["prior", "decoder", "sr32", "sr64"]
    assert [d.split(":")[0] for _, d in progress.calls] == [s for s in stages for _ in range(2)]
    fractions = [f for f, _ in progress.calls]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert progress.calls[1][1] == "prior: step 2/2"
    # the seed and the negative prompt reach the pipeline; a blank negative prompt is none
    again = h.generate(tiny_pipe, "a red circle", "  ", 3, 5, FEW)
    other = h.generate(tiny_pipe, "a red circle", "", 3, 6, FEW)
    negative = h.generate(tiny_pipe, "a red circle", "a blue square", 3, 5, FEW)
    assert np.array_equal(np.asarray(images[0]), np.asarray(again[0]))
    assert not np.array_equal(np.asarray(images[0]), np.asarray(other[0]))
    assert not np.array_equal(np.asarray(images[0]), np.asarray(negative[0]))


@needs_gradio
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt="   "), "Enter a prompt"),
        (dict(num_images=0), "number of images must be from 1 to 16, got 0"),
        (dict(num_images=2.5), "number of images must be a whole number"),
        (dict(seed=-1), "seed must be from 0"),
        (dict(sampling={"decoder": {"steps": 0}}), "decoder: steps must be an integer >= 1"),
        (dict(sampling={"sr128": {"steps": 2}}), "unknown stage 'sr128'"),
    ],
)
def test_generate_bad_input_is_a_message(tiny_pipe, kwargs, match):
    args = dict(prompt="a red circle", num_images=1, seed=0, sampling=FEW) | kwargs
    with pytest.raises(gr.Error, match=match) as exc:
        h.generate(tiny_pipe, **args)
    assert exc.value.print_exception is False  # the page shows it; no traceback in the console


@needs_gradio
def test_variations_and_interpolation(tiny_pipe, one_thread):
    images = h.variations(tiny_pipe, picture(), 2, 0, "", FEW)
    assert [im.size for im in images] == [(64, 64)] * 2
    with pytest.raises(gr.Error, match="Upload an image"):
        h.variations(tiny_pipe, None)
    progress = Recorder()
    frames = h.interpolate(tiny_pipe, "a red circle", "a blue square", 3, 0, FEW, progress)
    assert [im.size for im in frames] == [(64, 64)] * 3
    # the prior runs for both ends: its steps count twice and the bar still ends full
    assert [d.split(":")[0] for _, d in progress.calls].count("prior") == 4
    assert progress.calls[-1][0] == 1.0
    with pytest.raises(gr.Error, match="number of frames must be from 2"):
        h.interpolate(tiny_pipe, "a red circle", "a blue square", 1)
    with pytest.raises(gr.Error, match="Enter an end prompt"):
        h.interpolate(tiny_pipe, "a red circle", "")


def painted_editor(image, box):
    """An image editor's value: the image and one layer painted (opaque) over ``box``."""
    layer = Image.new("RGBA", image.size, (0, 0, 0, 0))
    layer.paste((0, 0, 0, 255), box)
    return {"background": image.convert("RGBA"), "layers": [layer], "composite": None}


@needs_gradio
def test_inpaint_regenerates_only_the_painted_region(tiny_pipe, one_thread):
    image = picture()
    editor = painted_editor(image, (32, 0, 64, 64))  # the right half
    out = h.inpaint(tiny_pipe, editor, None, "a green triangle", "", 2, 0, 1, FEW)
    assert len(out) == 2
    for im in out:
        got, src = np.asarray(im), np.asarray(image)
        assert np.array_equal(got[:, :32], src[:, :32])  # unpainted: the image's own pixels
        assert not np.array_equal(got[:, 32:], src[:, 32:])
    # an uploaded mask (white = regenerate) is used instead of the painted layers
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 16, 64))
    (im,) = h.inpaint(tiny_pipe, editor, mask, "a green triangle", "", 1, 0, 2, FEW)
    assert np.array_equal(np.asarray(im)[:, 16:], np.asarray(image)[:, 16:])


@needs_gradio
def test_inpaint_bad_input_is_a_message(tiny_pipe):
    image = picture()
    with pytest.raises(gr.Error, match="mask is 32x32 pixels but the image is 64x64"):
        h.inpaint(tiny_pipe, image, Image.new("L", (32, 32), 255), "a circle", sampling=FEW)
    unpainted = {"background": image, "layers": [Image.new("RGBA", (64, 64))], "composite": None}
    with pytest.raises(gr.Error, match="Paint over the region to regenerate, or upload a mask"):
        h.inpaint(tiny_pipe, unpainted, None, "a circle", sampling=FEW)
    with pytest.raises(gr.Error, match="mask selects no pixel"):
        h.inpaint(tiny_pipe, image, Image.new("L", (64, 64), 0), "a circle", sampling=FEW)
    with pytest.raises(gr.Error, match="Upload an image to inpaint"):
        h.inpaint(tiny_pipe, None, None, "a circle")
    with pytest.raises(gr.Error, match="Enter a prompt describing the edited image"):
        h.inpaint(tiny_pipe, painted_editor(image, (0, 0, 8, 8)), None, "")


@needs_gradio
def test_img2img_and_text_diff(tiny_pipe, one_thread):
    out = h.img2img(tiny_pipe, picture(), "a blue square", 0.5, "", 2, 0, FEW)
    assert [im.size for im in out] == [(64, 64)] * 2
    with pytest.raises(gr.Error, match="strength must be in"):
        h.img2img(tiny_pipe, picture(), "a blue square", 0.0, sampling=FEW)
    frames = h.text_diff(
        tiny_pipe, picture(), "a red circle", "a blue circle", 3, 0.5, 3, 0, FEW, Recorder()
    )
    assert [im.size for im in frames] == [(64, 64)] * 3
    with pytest.raises(gr.Error, match="encode identically"):
        h.text_diff(tiny_pipe, picture(), "a red circle", "a red circle", 2, 0.5, 3)
    with pytest.raises(gr.Error, match="Enter a caption of the image as it should become"):
        h.text_diff(tiny_pipe, picture(), "a red circle", " ")


@needs_gradio
def test_untouched_form_samples_as_the_pipeline(tiny_pipe):
    with gr.Blocks():
        form = SamplingForm(tiny_pipe)
    values = {c: c.value for c in form.components}
    assert tiny_pipe.sampling_settings(form.read(values)) == tiny_pipe.sampling_settings()
    by_label = {c.label: c for c in form.components}
    assert set(by_label) == {
        "prior steps",
        "prior guidance",
        "prior best of",
        "decoder steps",
        "decoder guidance",
        "decoder best of",
        "sr32 steps",
        "sr32 guidance",
        "sr64 steps",
        "sr64 guidance",
    }
    values[by_label["decoder steps"]] = 7.0  # sliders send floats
    values[by_label["sr64 guidance"]] = 3.5
    settings = tiny_pipe.sampling_settings(form.read(values))
    assert settings["decoder"].steps == 7 and settings["sr64"].guidance_scale == 3.5
    assert settings["sr32"] == tiny_pipe.sampling["sr32"]


@needs_gradio
def test_untouched_form_keeps_the_decoders_count_for_contrasted_prompts(tiny_pipe, monkeypatch):
    """A pipeline whose decoder draws more candidates for prompts with alternatives (the bundled
    model's ``best_of_contrasted``) gets a slider for that count: the form sends ``best_of``
    anyway, which alone would reset it."""
    from dataclasses import replace

    dec = replace(
        tiny_pipe.sampling["decoder"], best_of=2, best_of_contrasted=5, rerank_contrast="shapes"
    )
    monkeypatch.setitem(tiny_pipe.sampling, "decoder", dec)
    with gr.Blocks():
        form = SamplingForm(tiny_pipe)
    values = {c: c.value for c in form.components}
    assert tiny_pipe.sampling_settings(form.read(values))["decoder"].best_of_contrasted == 5
    assert tiny_pipe.sampling_settings(form.read(values)) == tiny_pipe.sampling_settings()
    slider = {c.label: c for c in form.components}["decoder best of, prompts with alternatives"]
    values[slider] = 7.0
    assert tiny_pipe.sampling_settings(form.read(values))["decoder"].best_of_contrasted == 7


def test_serve_without_gradio_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # what find_spec sees when it is absent
    assert cli.main(["serve", "--port", "9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "unclip serve: error: the web demo needs gradio, which is not installed: "
        "pip install 'unclip[demo]'"
    ]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--share"], "unrecognized arguments: --share"),  # the demo is never made public
        (["--port", "70000"], "a port must be from 1 to 65535"),
    ],
)
def test_serve_bad_arguments(args, match, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", *args])
    assert exc.value.code == 2 and match in capsys.readouterr().err


@needs_gradio
def test_serve_bad_model_or_device_is_one_line(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path / "none")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"unclip serve: error: pipeline folder not found: {tmp_path / 'none'}"
    assert cli.main(["serve", "--device", "gpu0"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("unclip serve: error: --device 'gpu0': ")


# ----------------------------------------------------------------- a token pipeline (DALL-E)
def tab_labels(demo) -> list:
    return [b.label for b in demo.blocks.values() if isinstance(b, gr.Tab)]


def text_labels(demo) -> list:
    return [b.label for b in demo.blocks.values() if isinstance(b, gr.Textbox)]


@needs_gradio
def test_token_pipeline_generate_images_seed_and_progress(token_parts, one_thread):
    pipe = token_pipeline(token_parts)  # 4 × 4 tokens → 16 px → sr32 (2 steps) → sr64 (1 step)
    progress = Recorder()
    images = h.generate(pipe, "a red circle", "", 3, 5, None, progress)
    assert len(images) == 3 and all(im.size == (64, 64) for im in images)
    # the bar follows each image token, then each upsampler step, and ends full
    stages = ["transformer"] * 16 + ["sr32"] * 2 + ["sr64"]
    assert [d.split(":")[0] for _, d in progress.calls] == stages
    assert progress.calls[15][1] == "transformer: token 16/16"
    fractions = [f for f, _ in progress.calls]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    again = h.generate(pipe, "a red circle", " ", 3, 5)
    other = h.generate(pipe, "a red circle", "", 3, 6)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images, again))
    assert not np.array_equal(np.asarray(images[0]), np.asarray(other[0]))
    # the transformer's settings reach it (top-k 1: the most likely token at every step)
    greedy = h.generate(pipe, "a red circle", "", 1, 5, {"transformer": {"top_k": 1}})
    assert not np.array_equal(np.asarray(greedy[0]), np.asarray(images[0]))
    with pytest.raises(gr.Error, match="negative_prompt applies to unCLIP pipelines"):
        h.generate(pipe, "a red circle", "a blue square", 1, 5)


@needs_gradio
def test_token_pipeline_untouched_form_samples_as_the_pipeline(token_parts, tiny_clip):
    from dataclasses import asdict

    from unclip.pipeline.token_pipeline import TokenPipeline
    from unclip.sampling.tokens import TokenSampling

    plain = token_pipeline(token_parts)  # default settings (top-k, top-p, α off), no CLIP
    tuned = TokenSampling(temperature=0.7, top_k=8, top_p=0.9, guidance_scale=3.0, candidates=2)
    parts = (plain.tokenizer, plain.tokenizer_config, plain.transformer, plain.transformer_config)
    reranked = TokenPipeline(*parts, tuned, clip=tiny_clip)
    for pipe in (plain, reranked):
        with gr.Blocks():
            form = SamplingForm(pipe)
        values = {c: c.value for c in form.components}
        sent = form.read(values)
        settings = asdict(pipe.sampling["transformer"])
        # not offered: the cache (speed only) and, without a CLIP, candidates (1 is all it takes)
        left_out = {"use_cache"} | ({"candidates"} if pipe.clip is None else set())
        assert sent["transformer"] == {k: v for k, v in settings.items() if k not in left_out}
        assert pipe.sampling_settings(sent) == pipe.sampling_settings()
    by_label = {c.label: c for c in form.components}
    assert set(by_label) == {
        "transformer temperature",
        "transformer top k (0: off)",
        "transformer top p (0: off)",
        "transformer guidance α (1: off)",
        "transformer candidates (best by CLIP)",
    }
    values[by_label["transformer top k (0: off)"]] = 0.0  # sliders send floats
    values[by_label["transformer guidance α (1: off)"]] = 1.0
    values[by_label["transformer candidates (best by CLIP)"]] = 4.0
    s = reranked.sampling_settings(form.read(values))["transformer"]
    assert (s.top_k, s.guidance_scale, s.candidates, s.top_p) == (None, None, 4, 0.9)
    # candidates need a CLIP to rerank with: the plain pipeline offers none, its upsamplers do
    with gr.Blocks():
        labels = {c.label for c in SamplingForm(plain).components}
    assert "transformer candidates (best by CLIP)" not in labels
    assert {"sr32 steps", "sr32 guidance", "sr64 steps", "sr64 guidance"} <= labels


@needs_gradio
def test_serve_builds_a_generate_only_page_for_a_token_pipeline(token_parts, tiny_pipe, tmp_path):
    from unclip.cli import serve

    token_pipeline(token_parts).save_pretrained(tmp_path / "tokens")
    args = serve.build_parser().parse_args(["--model", str(tmp_path / "tokens")])
    demo = serve.build_app(args)  # the command line's path up to the server
    assert tab_labels(demo) == ["Generate"]
    assert "Negative prompt (optional)" not in text_labels(demo)
    (header,) = [b.value for b in demo.blocks.values() if isinstance(b, gr.Markdown)]
    assert header.startswith("# DALL-E demo") and "Generate only" in header
    # the family's name, not its id (``dalle``), wherever the header names it
    assert "a DALL-E pipeline" in header and "dalle" not in header
    # an unCLIP pipeline's page keeps every tab and its negative prompts
    with_all = build_demo(tiny_pipe)
    assert {"Generate", "Variations", "Interpolate", "Edit"} <= set(tab_labels(with_all))
    assert "Negative prompt (optional)" in text_labels(with_all)


@pytest.fixture(scope="module")
def kandinsky_folder(tmp_path_factory):
    """A tiny Kandinsky 2.2 decoder folder whose model card names its prior (built offline)."""
    pytest.importorskip("transformers")
    from kandinsky_tiny import build_decoder, build_prior

    root = tmp_path_factory.mktemp("k22demo")
    build_prior(root / "prior")
    build_decoder(root / "decoder")
    (root / "decoder" / "README.md").write_text(f"---\nprior:\n- {root / 'prior'}\n---\n")
    return root / "decoder"


@needs_gradio
def test_serve_builds_a_kandinsky_page_whose_tabs_work(kandinsky_folder, one_thread):
    from unclip.cli import serve

    args = serve.build_parser().parse_args(["--model", str(kandinsky_folder), "--resolution", "32"])
    demo = serve.build_app(args)
    assert {"Generate", "Variations", "Interpolate", "Edit", "Image to image", "Text diff"} <= set(
        tab_labels(demo)
    )
    assert "Inpaint" not in tab_labels(demo)  # a text-to-image decoder does not repaint
    (header,) = [b.value for b in demo.blocks.values() if isinstance(b, gr.Markdown)]
    assert header.startswith("# Kandinsky 2.2 demo") and "32 px" in header
    from unclip.pipeline.auto import load_pipeline

    pipe = load_pipeline(kandinsky_folder)
    pipe.resolution = 32
    few = {"prior": {"steps": 2}, "decoder": {"steps": 2}}
    rec = Recorder()
    out = h.generate(pipe, "a red circle", "blue", 2, 0, few, rec)
    assert [im.size for im in out] == [(32, 32)] * 2 and rec.calls
    again = h.generate(pipe, "a red circle", "blue", 2, 0, few)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, again))
    assert [im.size for im in h.variations(pipe, picture(32), 2, 0, "", few)] == [(32, 32)] * 2
    with pytest.raises(gr.Error, match="reads no caption"):
        h.variations(pipe, picture(32), 1, 0, "a caption", few)
    frames = h.interpolate(pipe, "a red circle", "a blue square", 3, 0, few)
    assert len(frames) == 3
    assert len(h.img2img(pipe, picture(32), "a blue square", 0.5, "", 2, 0, few)) == 2
    frames = h.text_diff(pipe, picture(32), "a red circle", "a blue circle", 2, 0.5, 3, 0, few)
    assert [im.size for im in frames] == [(32, 32)] * 2
    with pytest.raises(ValueError, match="draws at its fixed resolution"):
        serve.build_app(serve.build_parser().parse_args(["--resolution", "32"]))


@needs_gradio
def test_a_kandinsky_inpainting_decoder_gets_the_inpaint_tab_alone(kandinsky_folder, tmp_path):
    from diffusers import KandinskyV22InpaintPipeline
    from kandinsky_tiny import build_decoder

    from unclip.pipeline.kandinsky import KandinskyPipeline

    build_decoder(tmp_path / "inpaint", KandinskyV22InpaintPipeline, in_channels=9)
    pipe = KandinskyPipeline.from_pretrained(
        tmp_path / "inpaint", prior=kandinsky_folder.parent / "prior"
    )
    pipe.resolution = 32
    demo = build_demo(pipe)
    # it repaints masked images and draws nothing from noise: no tab that would need that
    assert set(tab_labels(demo)) == {"Edit", "Inpaint"}
    assert "Resampling passes" not in [
        b.label for b in demo.blocks.values() if getattr(b, "visible", True) and hasattr(b, "label")
    ]
    editor = painted_editor(picture(32), (8, 8, 24, 24))
    few = {"prior": {"steps": 2}, "decoder": {"steps": 2}}
    out = h.inpaint(pipe, editor, None, "a red circle", "", 2, 0, 4, few)
    assert [im.size for im in out] == [(32, 32)] * 2
