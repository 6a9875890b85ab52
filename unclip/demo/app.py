"""A local web demo of a pipeline on Gradio: ``unclip serve`` (``pip install 'unclip[demo]'``).

    from unclip.demo import build_demo, launch
    launch(build_demo(UnCLIPPipeline.from_pretrained()))   # http://127.0.0.1:7860

Tabs: Generate (prompt, negative prompt, images, seed), Variations (an uploaded image), Interpolate
(two prompts, frames, a slider through them) and Edit (inpaint, image to image, text diff); one
panel of per-stage sampling settings (steps, guidance, best-of) serves every tab, and a progress
bar follows the denoising steps. Each tab calls a handler of :mod:`unclip.demo.handlers`.

A token pipeline (DALL-E, DALL-E Mega: :class:`~unclip.pipeline.token_pipeline.TokenPipeline`)
gets the Generate tab alone, without a negative prompt: the other tabs work on CLIP image
embeddings, which it does not make (the page's header says so). Its panel holds the transformer's
settings (temperature, top-k, top-p, super-conditioning α, candidates when it has a CLIP to rerank
with) and its upsamplers' steps and guidance; the progress bar follows the image tokens, then the
upsamplers' denoising steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# before gradio is imported (see unclip.demo.handlers)
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import gradio as gr  # noqa: E402

from unclip.demo.handlers import (  # noqa: E402
    MAX_IMAGES,
    generate,
    img2img,
    inpaint,
    interpolate,
    text_diff,
    variations,
    whole_number,
)
from unclip.nets.token_components import tokenizer_facts  # noqa: E402
from unclip.pipeline.token_pipeline import TokenPipeline  # noqa: E402
from unclip.sampling.tokens import TokenSampling  # noqa: E402

__all__ = ["SamplingForm", "build_demo", "launch"]

#: stages whose ``best_of`` the form offers (an upsampler takes 1)
BEST_OF_STAGES = ("prior", "decoder")
#: the name a token family's page shows for its family id (``TokenPipeline.family``)
FAMILY_NAMES = {"dalle": "DALL-E", "dalle_mega": "DALL-E Mega"}
#: a form value → the setting it sends, given the label to name in an error
Convert = Callable[[Any, str], Any]


def _count(value, label: str) -> int:
    return whole_number(value, label, 1)


def _scale(value, label: str) -> float:
    return float(value)


def _off_at(off: float, whole: bool = False) -> Convert:
    """A slider whose value ``off`` means the setting's ``None`` (top-k, top-p, α: switched off)."""

    def convert(value, label: str):
        v = whole_number(value, label, 0) if whole else float(value)
        return None if v == off else v

    return convert


class SamplingForm:
    """Sliders for each stage's steps and guidance (and prior/decoder best-of), or a token
    pipeline's transformer settings, starting at the pipeline's own settings (so an untouched form
    samples as the pipeline does); :meth:`read` turns their values into ``sampling=`` overrides."""

    def __init__(self, pipe):
        self.fields: list[tuple[str, str, Any, Convert]] = []
        for stage in pipe.stage_names:
            s = pipe.sampling[stage]
            with gr.Row():
                if isinstance(s, TokenSampling):
                    self._add_token_settings(pipe, stage, s)
                    continue
                self._add(
                    stage,
                    "steps",
                    gr.Slider(1, max(200, s.steps), value=s.steps, step=1, label=f"{stage} steps"),
                )
                self._add(
                    stage,
                    "guidance_scale",
                    gr.Slider(
                        0,
                        max(20, s.guidance_scale),
                        value=s.guidance_scale,
                        step=0.5,
                        label=f"{stage} guidance",
                    ),
                    _scale,
                )
                if stage in BEST_OF_STAGES:
                    self._add_count(stage, "best_of", s.best_of, f"{stage} best of")
                # a best_of sent alone would reset it, so a model that sets it gets its own slider
                if getattr(s, "best_of_contrasted", None) is not None:  # the decoder's only
                    label = f"{stage} best of, prompts with alternatives"
                    self._add_count(stage, "best_of_contrasted", s.best_of_contrasted, label)

    def _add_token_settings(self, pipe, stage: str, s: TokenSampling) -> None:
        """A token transformer's settings. The ones that can be off (``None``) are off at a value
        they cannot take (top-k 0, top-p 0) or at α = 1, where super-conditioning's mix is the
        conditional logits alone (which ``None`` computes in one pass instead of two)."""
        t = s.temperature
        temperature = gr.Slider(0.05, max(2.0, t), value=t, step=0.05, label=f"{stage} temperature")
        self._add(stage, "temperature", temperature, _scale)
        vocab = pipe.transformer_config.model.image_vocab_size
        k = s.top_k or 0
        top_k = gr.Slider(0, max(vocab, k), value=k, step=1, label=f"{stage} top k (0: off)")
        self._add(stage, "top_k", top_k, _off_at(0, whole=True))
        top_p = gr.Slider(0, 1, value=s.top_p or 0, step=0.01, label=f"{stage} top p (0: off)")
        self._add(stage, "top_p", top_p, _off_at(0))
        a = 1.0 if s.guidance_scale is None else s.guidance_scale
        alpha = gr.Slider(
            min(1.0, a), max(20.0, a), value=a, step=0.5, label=f"{stage} guidance α (1: off)"
        )
        self._add(stage, "guidance_scale", alpha, _off_at(1))
        # candidates are reranked by the pipeline's CLIP: without one only 1 can be sampled
        if pipe.clip is not None or s.candidates != 1:
            self._add_count(stage, "candidates", s.candidates, f"{stage} candidates (best by CLIP)")

    def _add_count(self, stage: str, field: str, value: int, label: str) -> None:
        """A slider for a number of candidates, from 1 to at least 32."""
        self._add(stage, field, gr.Slider(1, max(32, value), value=value, step=1, label=label))

    def _add(self, stage: str, field: str, component, convert: Convert = _count) -> None:
        self.fields.append((stage, field, component, convert))

    @property
    def components(self) -> list:
        return [c for _, _, c, _ in self.fields]

    def read(self, values: Mapping) -> dict:
        out: dict[str, dict] = {}
        for stage, field, component, convert in self.fields:
            label = f"{stage} {field.replace('_', ' ')}"
            out.setdefault(stage, {})[field] = convert(values[component], label)
        return out


def _describe(pipe, model_name: str) -> str:
    model = f"Model: **{model_name or 'pipeline'}**"
    images = f"images {pipe.resolution} px on {pipe.device}"
    if isinstance(pipe, TokenPipeline):
        size = tokenizer_facts(pipe.tokenizer_config)["image_size"]
        name = FAMILY_NAMES[pipe.family]  # the transformer's type sets the family
        stages = [
            f"{name} transformer ({pipe.num_image_tokens} image tokens)",
            f"{pipe.tokenizer_config.type} {size} px",
            *pipe.upsampler_names,
        ]
        return (
            f"# {name} demo\n{model} · stages: {' → '.join(stages)} · {images}.\n\n"
            "Generate only: Variations, Interpolate and Edit work on CLIP image embeddings, "
            f"which a {name} pipeline does not make, and it takes no negative prompt."
        )
    if getattr(pipe, "family", None) == "kandinsky":
        stages = (["prior"] if pipe.prior is not None else []) + ["latent decoder (MoVQ)"]
        edits = "Inpaint" if pipe.decoder.inpaint else "Image to image, Text diff"
        return (
            f"# Kandinsky 2.2 demo\n{model} · stages: {' → '.join(stages)} · {images}. "
            f"Sampling settings below apply to every tab; Edit offers {edits}."
        )
    sizes = [f"decoder {pipe.decoder.config.sample_size} px", *pipe.upsampler_names]
    stages = (["prior"] if pipe.prior is not None else []) + sizes
    return (
        f"# unCLIP demo\n{model} · stages: {' → '.join(stages)} · {images}. "
        "Sampling settings below apply to every tab."
    )


def build_demo(pipe, model_name: str = "", examples: Sequence[str] = ()) -> gr.Blocks:
    """The web app of ``pipe`` (any family's pipeline; see the module doc): a ``gr.Blocks`` to
    ``.queue().launch()``. Every event shares one queue slot, so one request at a time uses the
    pipeline. ``examples``: prompts offered under the Generate tab."""
    one_at_a_time = dict(concurrency_limit=1, concurrency_id="pipeline")
    tokens = isinstance(pipe, TokenPipeline)
    kandinsky = getattr(pipe, "family", None) == "kandinsky"
    title = (
        f"{FAMILY_NAMES[pipe.family]} demo"
        if tokens
        else "Kandinsky 2.2 demo"
        if kandinsky
        else "unCLIP demo"
    )
    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        gr.Markdown(_describe(pipe, model_name))
        with gr.Accordion("Sampling settings" + ("" if tokens else " (every tab)"), open=False):
            form = SamplingForm(pipe)

        def wire(button, handler, inputs: dict, outputs, after=None):
            """``inputs``: handler keyword → component; the form's settings go in as
            ``sampling=`` and the page's progress bar as ``progress=``."""

            def run(values, progress=gr.Progress()):
                kwargs = {k: values[c] for k, c in inputs.items()}
                images = handler(pipe, sampling=form.read(values), progress=progress, **kwargs)
                return after(images) if after else images

            button.click(
                run, inputs={*inputs.values(), *form.components}, outputs=outputs, **one_at_a_time
            )

        # an inpainting decoder repaints masked images only: nothing to draw from noise
        draws = not (kandinsky and pipe.decoder.inpaint)
        if draws:
            _generate_tab(wire, tokens, examples)

        if not tokens:
            _embedding_tabs(wire, pipe, kandinsky)
    return demo


def _generate_tab(wire, tokens: bool, examples: Sequence[str]) -> None:
    with gr.Tab("Generate"):
        with gr.Row():
            with gr.Column():
                prompt = gr.Textbox(label="Prompt", elem_id="prompt", lines=2)
                inputs: dict[str, Any] = dict(prompt=prompt)
                if not tokens:
                    negative = gr.Textbox(label="Negative prompt (optional)")
                    inputs["negative_prompt"] = negative
                with gr.Row():
                    count = gr.Slider(1, MAX_IMAGES, value=4, step=1, label="Images")
                    seed = gr.Number(0, precision=0, label="Seed")
                go = gr.Button("Generate", variant="primary", elem_id="generate")
                if examples:
                    gr.Examples([[e] for e in examples], inputs=[prompt])
            gallery = gr.Gallery(label="Images", elem_id="gallery", format="png", columns=4)
        wire(go, generate, dict(inputs, num_images=count, seed=seed), gallery)


def _embedding_tabs(wire, pipe, kandinsky: bool = False) -> None:
    """The tabs that work on CLIP image embeddings: an unCLIP or Kandinsky pipeline's. A
    Kandinsky decoder reads no caption, and repaints (Inpaint) only when it is an inpainting
    decoder, which in turn draws nothing from noise (no Variations, Interpolate, Image to image or
    Text diff; no Generate either)."""
    if not (kandinsky and pipe.decoder.inpaint):
        with gr.Tab("Variations"):
            with gr.Row():
                with gr.Column():
                    source = gr.Image(label="Image", type="pil", image_mode="RGB")
                    caption = gr.Textbox(
                        label="Caption for the decoder (optional)", visible=not kandinsky
                    )
                    with gr.Row():
                        v_count = gr.Slider(1, MAX_IMAGES, value=4, step=1, label="Images")
                        v_seed = gr.Number(0, precision=0, label="Seed")
                    v_go = gr.Button("Make variations", variant="primary", elem_id="variations")
                v_gallery = gr.Gallery(
                    label="Variations", elem_id="variations-gallery", format="png", columns=4
                )
            inputs = dict(image=source, caption=caption, num_images=v_count, seed=v_seed)
            wire(v_go, variations, inputs, v_gallery)

        with gr.Tab("Interpolate"):
            with gr.Row():
                with gr.Column():
                    start = gr.Textbox(label="Start prompt", elem_id="start-prompt")
                    end = gr.Textbox(label="End prompt", elem_id="end-prompt")
                    with gr.Row():
                        frames = gr.Slider(2, MAX_IMAGES, value=5, step=1, label="Frames")
                        i_seed = gr.Number(0, precision=0, label="Seed")
                    i_go = gr.Button("Interpolate", variant="primary", elem_id="interpolate")
                with gr.Column():
                    frame = gr.Image(
                        label="Frame", type="pil", format="png", interactive=False, height=256
                    )
                    pick = gr.Slider(0, 4, value=0, step=1, label="Frame (start → end)")
                    i_gallery = gr.Gallery(
                        label="Frames", elem_id="interpolate-gallery", format="png", columns=5
                    )
            stored = gr.State([])

            def shown(images):
                return images, images, images[0], gr.Slider(maximum=len(images) - 1, value=0)

            inputs = dict(start=start, end=end, num_frames=frames, seed=i_seed)
            wire(i_go, interpolate, inputs, [i_gallery, stored, frame, pick], after=shown)
            pick.change(
                lambda images, i: images[int(i)] if images and int(i) < len(images) else None,
                inputs=[stored, pick],
                outputs=frame,
            )

    with gr.Tab("Edit"):
        inpaints = not kandinsky or pipe.decoder.inpaint
        _edit_tabs(
            wire, inpaint_tab=inpaints, other_tabs=not (kandinsky and inpaints), one_pass=kandinsky
        )


def _edit_tabs(
    wire, inpaint_tab: bool = True, other_tabs: bool = True, one_pass: bool = False
) -> None:
    if inpaint_tab:
        _inpaint_tab(wire, one_pass)
    if other_tabs:
        _img2img_and_text_diff_tabs(wire)


def _inpaint_tab(wire, one_pass: bool) -> None:
    """``one_pass``: the model repaints in one pass (no resampling passes to choose)."""
    with gr.Tab("Inpaint"):
        with gr.Row():
            with gr.Column():
                editor = gr.ImageMask(
                    label="Image: paint over what to regenerate",
                    type="pil",
                    image_mode="RGBA",
                    sources=["upload", "clipboard"],
                    layers=False,
                    transforms=(),
                )
                mask = gr.Image(
                    label="Or upload a mask of the same size (white = regenerate)",
                    type="pil",
                    image_mode="L",
                )
                prompt = gr.Textbox(
                    label="Prompt describing the whole edited image", elem_id="inpaint-prompt"
                )
                negative = gr.Textbox(label="Negative prompt (optional)")
                with gr.Row():
                    count = gr.Slider(1, MAX_IMAGES, value=2, step=1, label="Images")
                    passes = gr.Slider(
                        1, 8, value=4, step=1, label="Resampling passes", visible=not one_pass
                    )
                    seed = gr.Number(0, precision=0, label="Seed")
                go = gr.Button("Inpaint", variant="primary", elem_id="inpaint")
            gallery = gr.Gallery(
                label="Inpainted", elem_id="inpaint-gallery", format="png", columns=2
            )
        inputs = dict(
            image=editor,
            mask=mask,
            prompt=prompt,
            negative_prompt=negative,
            num_images=count,
            resample=passes,
            seed=seed,
        )
        wire(go, inpaint, inputs, gallery)


def _img2img_and_text_diff_tabs(wire) -> None:
    with gr.Tab("Image to image"):
        with gr.Row():
            with gr.Column():
                image = gr.Image(label="Image", type="pil", image_mode="RGB")
                prompt = gr.Textbox(label="Prompt")
                negative = gr.Textbox(label="Negative prompt (optional)")
                strength = gr.Slider(0.05, 1.0, value=0.6, step=0.05, label="Strength")
                with gr.Row():
                    count = gr.Slider(1, MAX_IMAGES, value=2, step=1, label="Images")
                    seed = gr.Number(0, precision=0, label="Seed")
                go = gr.Button("Transform", variant="primary", elem_id="img2img")
            gallery = gr.Gallery(
                label="Results", elem_id="img2img-gallery", format="png", columns=2
            )
        inputs = dict(
            image=image,
            prompt=prompt,
            strength=strength,
            negative_prompt=negative,
            num_images=count,
            seed=seed,
        )
        wire(go, img2img, inputs, gallery)

    with gr.Tab("Text diff"):
        with gr.Row():
            with gr.Column():
                image = gr.Image(label="Image", type="pil", image_mode="RGB")
                source = gr.Textbox(label="Caption of the image as it is")
                target = gr.Textbox(label="Caption of the image as it should become")
                with gr.Row():
                    frames = gr.Slider(1, MAX_IMAGES, value=5, step=1, label="Frames")
                    theta = gr.Slider(0.05, 1.0, value=0.5, step=0.05, label="Largest turn θ")
                with gr.Row():
                    steps = gr.Slider(5, 200, value=50, step=1, label="Inversion steps")
                    seed = gr.Number(0, precision=0, label="Seed")
                go = gr.Button("Apply text diff", variant="primary", elem_id="text-diff")
            gallery = gr.Gallery(
                label="θ = 0 … largest", elem_id="text-diff-gallery", format="png", columns=5
            )
        inputs = dict(
            image=image,
            source_caption=source,
            target_caption=target,
            num_frames=frames,
            max_theta=theta,
            inversion_steps=steps,
            seed=seed,
        )
        wire(go, text_diff, inputs, gallery)


#: the largest file a visitor may upload by default (an image of a few thousand pixels a side)
MAX_UPLOAD_BYTES = 20 * 2**20


def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int = 7860,
    block: bool = True,
    max_upload_bytes: int = MAX_UPLOAD_BYTES,
) -> str:
    """Serve ``demo`` on ``host:port`` and return its address; never through a public share link
    (gradio's own start-up lines, which suggest one, are left out). ``block``: wait until Ctrl-C
    (else return once the server is up; ``demo.close()`` stops it). ``max_upload_bytes``: the
    server refuses a larger upload (HTTP 413) before it is stored or decoded."""
    if max_upload_bytes < 1:
        raise ValueError(f"max_upload_bytes must be >= 1, got {max_upload_bytes}")
    demo.queue(default_concurrency_limit=1).launch(
        max_file_size=int(max_upload_bytes),
        server_name=host,
        server_port=port,
        share=False,
        inbrowser=False,
        show_error=True,
        prevent_thread_lock=True,
        quiet=True,
    )
    url = demo.local_url
    if url is None:  # gradio sets it once the server listens
        raise RuntimeError("the web demo's server did not start")
    if block:
        print(f"unclip serve: running on {url} (Ctrl-C stops it)", flush=True)
        demo.block_thread()
    return url
