"""Speed options of ``UnCLIPPipeline`` leave results unchanged (within stated tolerances), and the
sampling loop does the work once: conditioning once per call, guided + unguided passes in one batch.

Timing is measured in ``benchmarks/`` (see benchmarks/README.md), never asserted here.

Tolerances:
* ``pipe.to(memory_format=torch.channels_last)``: images within 1e-4 (float rounding of NHWC
  convolutions).
* ``pipe.compile()`` (inductor): prior embeddings within 1e-5 (only the prior is compiled here:
  compiling the UNets takes minutes on a CPU; benchmarks/bench_compile.py measures them).
* ``from_pretrained``'s defaults (channels-last, autocast ``"auto"``): bf16 in every network exactly
  where the CPU runs it natively, else the fp32 images; one keyword away, bit-identical fp32.
* ``pipe.autocast_dtype = torch.bfloat16``: every network's first output (same input) within 3%
  relative L2 error, prior embeddings within 0.05 absolute. End-to-end images of *random* networks
  are not compared: an epsilon-predicting step at t = T divides the error by sqrt(alpha_bar_T), so
  any rounding change flips clipped pixels of an untrained decoder.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.pipeline.tiny import tiny_pipeline

PROMPTS = ["a red circle", "a blue square"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _images(pipe, **kw):
    return pipe(
        PROMPTS, generator=_gen(), output_type="pt", progress=False, return_intermediates=True, **kw
    )


def _step_modules(pipe) -> dict:
    """The module each stage's sampler calls at every step: the denoising networks, except the
    prior's, whose sampler runs the transformer's blocks itself (the text positions once, then
    three positions per step: ``UnCLIPPrior.conditioned``) — its last block stands for it."""
    nets = pipe.denoisers()
    nets["prior"] = pipe.prior.transformer.transformer_blocks[-1]
    return nets


#: the prior's first per-step pass (three positions), recorded beside its first (text) pass
PRIOR_STEP = "prior step"


def _record_first_outputs(pipe):
    """Forward hooks on every stage's step module: first output (as fp32), whether autocast was
    on inside, its dtype and the output's own dtype. The prior's last block first runs over the
    text positions, then over the three per-step positions: both are recorded."""
    seen, handles = {}, []
    for name, net in _step_modules(pipe).items():

        def hook(module, args, out, name=name):
            # the pipeline calls the networks with return_dict=False; a block returns a tensor
            out = out[0] if isinstance(out, tuple) else out
            key = name
            if name == "prior" and name in seen and out.shape[1] == 3:
                key = PRIOR_STEP
            if key not in seen:
                seen[key] = (
                    out.detach().float().clone(),
                    torch.is_autocast_enabled("cpu"),
                    torch.get_autocast_dtype("cpu"),
                    out.dtype,
                )

        handles.append(net.register_forward_hook(hook))
    return seen, handles


# ----------------------------------------------------------------------------------------- autocast
def test_full_precision_is_the_default():
    pipe = tiny_pipeline(seed=0)
    assert pipe.autocast_dtype is None
    seen, handles = _record_first_outputs(pipe)
    _images(pipe)
    for h in handles:
        h.remove()
    assert set(seen) == {*_step_modules(pipe), PRIOR_STEP}
    assert all(not enabled and dtype == torch.float32 for _, enabled, _, dtype in seen.values())


def _stage_first_outputs(pipe):
    """Each stage run alone from the same inputs: first output of every network, and the prior's
    embeddings."""
    seen, handles = _record_first_outputs(pipe)
    embeds = pipe.sample_image_embeds(PROMPTS, generator=_gen(), progress=False)
    pipe.decode(
        torch.randn(len(PROMPTS), pipe.clip.embed_dim, generator=_gen(1)),
        PROMPTS,
        generator=_gen(),
        progress=False,
    )
    for name, up in zip(pipe.upsampler_names, pipe.upsamplers):
        low = (
            torch.rand(
                len(PROMPTS), 3, up.config.low_res_size, up.config.low_res_size, generator=_gen(2)
            )
            * 2
            - 1
        )
        pipe.upsample(low, generator=_gen(), stages=[name], progress=False)
    for h in handles:
        h.remove()
    return seen, embeds


def test_bf16_autocast_within_tolerance():
    pipe = tiny_pipeline(seed=0)
    ref_seen, ref_embeds = _stage_first_outputs(pipe)
    ref = _images(pipe)

    pipe.autocast_dtype = torch.bfloat16
    seen, embeds = _stage_first_outputs(pipe)
    out = _images(pipe)
    assert set(seen) == set(ref_seen) == {*_step_modules(pipe), PRIOR_STEP}
    for name, (o, enabled, dtype, _) in seen.items():
        assert enabled and dtype == torch.bfloat16, (
            name
        )  # the option is in effect inside every network
        r = ref_seen[name][0]
        rel = float((o - r).norm() / r.norm())
        assert 0 < rel <= 0.03, (name, rel)  # changed (bf16 really used) but only by bf16 rounding
    assert float((embeds - ref_embeds).abs().max()) <= 0.05
    # weights, latents and outputs stay fp32; images valid
    assert pipe.decoder.dtype == torch.float32 and out.images.dtype == torch.float32
    assert out.images.shape == ref.images.shape and torch.isfinite(out.images).all()
    assert 0 <= float(out.images.min()) and float(out.images.max()) <= 1
    pipe.autocast_dtype = None  # back to exactly the fp32 results
    torch.testing.assert_close(_images(pipe).images, ref.images, atol=0, rtol=0)


def test_autocast_dtype_is_validated():
    pipe = tiny_pipeline(seed=0)
    for bad, error, match in (
        (torch.int8, ValueError, "bfloat16"),
        ("bf17", ValueError, "auto, bf16, fp16 or none"),
        (16, TypeError, "torch.dtype"),
    ):
        with pytest.raises(error, match=match):
            pipe.autocast_dtype = bad
        assert pipe.autocast_dtype is None and pipe.autocast_setting is None  # left as it was
    # names and float32 (full precision) are read as the dtypes they name
    for value, setting in (
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.float32, None),
        ("none", None),
        ("AUTO", "auto"),
    ):
        pipe.autocast_dtype = value
        assert pipe.autocast_setting == setting, value


def test_auto_autocast_follows_the_device_and_the_cpu(monkeypatch):
    from unclip.utils import precision

    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: True)
    assert precision.resolve_autocast("auto", "cpu") == torch.bfloat16
    assert precision.resolve_autocast("auto", "cuda:1") == torch.float16
    assert precision.resolve_autocast("auto", "meta") is None
    assert precision.resolve_autocast(torch.float16, "cpu") == torch.float16
    assert precision.resolve_autocast(None, "cuda") is None
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: False)
    assert precision.resolve_autocast("auto", "cpu") is None  # emulated bf16 is slower than fp32
    pipe = tiny_pipeline(seed=0)
    pipe.autocast_dtype = "auto"
    assert pipe.autocast_setting == "auto" and pipe.autocast_dtype is None
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: True)
    assert pipe.autocast_dtype == torch.bfloat16  # resolved when read, not when set
    # half-precision weights set the arithmetic themselves
    assert precision.resolve_autocast("auto", "cuda", torch.float16) is None
    pipe.to(torch.bfloat16)
    assert pipe.autocast_dtype is None
    assert _images(pipe).images.isfinite().all()  # (bf16 autocast here: a mixed-dtype error)


@pytest.mark.parametrize("native", [True, False])
def test_loaded_pipeline_samples_with_the_fast_settings_asked_for(native, monkeypatch, tmp_path):
    """from_pretrained is exact by default (no autocast); asked for autocast "auto", a CPU that
    runs bf16 natively computes every network in bf16 (the same images as asking for bf16), and
    elsewhere in full precision (the same images as fp32); image networks are channels-last."""
    from unclip.utils import precision

    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: native)
    saved = tiny_pipeline(seed=0)
    saved.save_pretrained(tmp_path / "p")
    assert UnCLIPPipeline.from_pretrained(tmp_path / "p").autocast_dtype is None
    pipe = UnCLIPPipeline.from_pretrained(tmp_path / "p", autocast_dtype="auto")
    assert pipe.autocast_setting == "auto"
    assert pipe.autocast_dtype == (torch.bfloat16 if native else None)
    for net in [pipe.decoder.unet, *(u.unet for u in pipe.upsamplers)]:
        assert net.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    seen, handles = _record_first_outputs(pipe)
    out = _images(pipe)
    for h in handles:
        h.remove()
    assert set(seen) == {*_step_modules(pipe), PRIOR_STEP}
    for name, (_, enabled, dtype, _) in seen.items():
        assert enabled == native and (not native or dtype == torch.bfloat16), name
    same = UnCLIPPipeline.from_pretrained(tmp_path / "p", autocast_dtype="bf16" if native else None)
    torch.testing.assert_close(_images(same).images, out.images, atol=0, rtol=0)
    # and one keyword away, the saved pipeline's own full-precision images, bit for bit
    exact = UnCLIPPipeline.from_pretrained(tmp_path / "p", autocast_dtype=None, memory_format=None)
    assert exact.autocast_dtype is None
    assert exact.decoder.unet.conv_in.weight.is_contiguous()
    torch.testing.assert_close(_images(exact).images, _images(saved).images, atol=0, rtol=0)
    with pytest.raises(ValueError, match="auto, bf16, fp16 or none"):
        UnCLIPPipeline.from_pretrained(tmp_path / "p", autocast_dtype="half-ish")


# ------------------------------------------------------------------------------------ channels-last
def test_channels_last_same_images():
    pipe = tiny_pipeline(seed=0)
    ref = _images(pipe)
    pipe.to(memory_format=torch.channels_last)
    for net in [pipe.decoder.unet, *(u.unet for u in pipe.upsamplers)]:
        assert net.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    out = _images(pipe)
    assert float((out.images - ref.images).abs().max()) <= 1e-4
    for stage, img in ref.stage_images.items():
        assert float((out.stage_images[stage] - img).abs().max()) <= 1e-4, stage
    with tempfile.TemporaryDirectory() as tmp:  # saving channels-last weights round-trips
        pipe.save_pretrained(tmp)
        again = _images(UnCLIPPipeline.from_pretrained(tmp, autocast_dtype=None))
    assert float((again.images - ref.images).abs().max()) <= 1e-4


# ------------------------------------------------------------------------------------------ compile
def test_compile_keeps_weights_and_results():
    pipe = tiny_pipeline(seed=0)
    keys = {n: list(m.state_dict()) for n, m in pipe.modules().items()}
    ref = pipe.sample_image_embeds(PROMPTS, generator=_gen(), progress=False)
    assert pipe.compile() is pipe
    assert all(net._compiled_call_impl is not None for net in pipe.denoisers().values())
    assert {
        n: list(m.state_dict()) for n, m in pipe.modules().items()
    } == keys  # no "_orig_mod." prefixes
    out = pipe.sample_image_embeds(
        PROMPTS, generator=_gen(), progress=False
    )  # compiles the prior (inductor)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- work done once
def test_conditioning_once_and_guidance_batched(monkeypatch):
    pipe = tiny_pipeline(seed=0)
    steps = {"prior": 4, "decoder": 5}
    sampling = {
        "prior": {"steps": steps["prior"], "guidance_scale": 2.0, "best_of": 2},
        "decoder": {"steps": steps["decoder"], "guidance_scale": 2.0},
        "upsampler": {"steps": 3, "guidance_scale": 1.0},
    }
    calls = {"condition": 0, "encode_text": 0}
    condition, encode_text = pipe.decoder.condition, pipe.clip.encode_text

    def counted_condition(*a, **k):
        calls["condition"] += 1
        return condition(*a, **k)

    def counted_encode_text(*a, **k):
        calls["encode_text"] += 1
        return encode_text(*a, **k)

    monkeypatch.setattr(pipe.decoder, "condition", counted_condition)
    monkeypatch.setattr(pipe.clip, "encode_text", counted_encode_text)
    batches = {name: [] for name in pipe.denoisers()}
    lengths = []  # the prior block's sequence length per call
    handles = [
        net.register_forward_pre_hook(
            lambda m, a, k, name=name: batches[name].append(
                (a[0] if a else next(iter(k.values()))).shape[0]
            ),
            with_kwargs=True,
        )
        for name, net in _step_modules(pipe).items()
    ]
    handles.append(
        pipe.prior.transformer.transformer_blocks[-1].register_forward_pre_hook(
            lambda m, a: lengths.append(a[0].shape[1])
        )
    )
    pipe(PROMPTS, generator=_gen(), sampling=sampling, output_type="pt", progress=False)
    for h in handles:
        h.remove()
    b = len(PROMPTS)
    assert calls["condition"] == 1  # decoder conditioning: once per call, not per step
    assert calls["encode_text"] == 2  # the prompts, and the empty caption once (cached afterwards)
    # [uncond; cond] × best_of in ONE pass per step, after one pass over the text positions
    assert batches["prior"] == [2 * b * 2] * (1 + steps["prior"])
    assert lengths == [pipe.clip.context_length + 1] + [3] * steps["prior"]
    assert batches["decoder"] == [2 * b] * steps["decoder"]
    assert (
        batches["sr32"] == [b] * 3 and batches["sr64"] == [b] * 3
    )  # guidance 1: no unconditional pass
