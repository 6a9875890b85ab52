"""Per-stage model offload (unclip.utils.offload): on fake CUDA tensors each component is on the GPU
only while its stage runs, and on real CPU tensors the hooks change no image."""

from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny"


def _decoder_with_caption_transformer(tmp_path) -> str:
    """configs/tiny/decoder.yaml with the decoder's own caption transformer (its token ids are
    made on the CPU, before the decoder runs)."""
    cfg = yaml.safe_load((TINY / "decoder.yaml").read_text())
    cfg["decoder"].update(
        text_encoder="transformer",
        text_encoder_width=32,
        text_encoder_layers=1,
        text_encoder_heads=2,
        text_context_length=16,
    )
    path = tmp_path / "decoder_text.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_offload_keeps_one_component_on_the_gpu(tmp_path, capsys):
    """Fake CUDA: the cascade (autoregressive prior, a decoder with its own caption transformer, an
    upsampler) samples with no device mismatch; while each stage runs only its component's weights
    are on the GPU, and the peak is below that of the whole cascade resident."""
    from unclip.cli.plan import main
    from unclip.train.plan_sampling import measure_sampling

    cfgs = [str(TINY / "prior_ar.yaml"), _decoder_with_caption_transformer(tmp_path)]
    cfgs.append(str(TINY / "sr32.yaml"))
    resident = measure_sampling(cfgs, batch=2)
    offload = measure_sampling(cfgs, batch=2, offload=True)
    assert offload.output_shape == resident.output_shape == [2, 3, 32, 32]
    assert offload.resident == {"prior": ["prior"], "decoder": ["decoder"], "sr32": ["sr32"]}
    assert resident.resident["decoder"] == ["clip", "decoder", "prior", "sr32"]
    assert offload.weights == pytest.approx(resident.weights, rel=0.05)
    for stage in offload.stages:  # each stage holds one component's weights, not four
        assert offload.stage_peaks[stage] < resident.stage_peaks[stage]
    assert offload.peak < resident.peak
    assert main(["--sample", *cfgs, "--offload"]) == 0
    assert "per-stage model offload" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(TINY / "prior.yaml"), "--offload"])  # --offload plans sampling only


def test_edits_and_variations_under_offload_on_fake_cuda():
    """The edit paths build their denoisers outside the pipeline's own stages: each brings its
    component in (image-to-image through the decoder and the upsampler; variations through the
    CLIP's image tower)."""
    from unittest import mock

    from unclip.train.plan import _FakeCUDA
    from unclip.train.plan_sampling import _pipeline_from_configs

    cfgs = [TINY / f"{n}.yaml" for n in ("prior", "decoder", "sr32")]
    with _FakeCUDA(), torch.no_grad(), mock.patch("torch.cuda.synchronize", lambda *a, **k: None):
        pipe = _pipeline_from_configs(cfgs)
        pipe.enable_model_cpu_offload(device="cuda:0")
        steps = {name: {"steps": 2} for name in pipe.stage_names}
        image = torch.zeros(1, 3, 16, 16)
        kw = dict(sampling=steps, output_type="pt", progress=False)
        assert pipe.img2img(image, "a red circle", strength=0.5, **kw).images.shape[-1] == 32
        assert pipe.variations(image, **kw).images.shape[-1] == 32
        loads = pipe.model_cpu_offload.loads
        assert loads["decoder"] == 2 and loads["sr32"] == 2 and loads["clip"] >= 2
        assert pipe.model_cpu_offload.active is None  # pipe() leaves no weights on the GPU
        assert not any(p.is_cuda for m in pipe.modules().values() for p in m.parameters())


def test_half_precision_rule_and_attention_slicing_on_fake_cuda():
    """Fake CUDA at fp16: the prior's embedding statistics stay float32 as torch_dtype keeps them
    (unclip.utils.precision) and the cascade still samples with no dtype mismatch; attention
    sliced one head at a time runs on CUDA and lowers the attention stages' peaks."""
    from unclip.train.plan_sampling import measure_sampling

    cfgs = [str(TINY / f"{n}.yaml") for n in ("prior", "decoder", "sr32")]
    full = measure_sampling(cfgs, batch=2)
    sliced = measure_sampling(cfgs, batch=2, attention_slicing="max")
    # the dtypes the tensors have on the GPU, read back after the conversion
    assert full.fp32_tensors == ["prior.transformer.clip_mean", "prior.transformer.clip_std"]
    assert sliced.output_shape == full.output_shape == [2, 3, 32, 32]
    assert sliced.attention_slicing == "max"
    for stage in ("decoder", "sr32"):  # UNets with attention layers
        assert sliced.stage_peaks[stage] < full.stage_peaks[stage]


def test_offload_hooks_activate_in_stage_order_and_change_no_image(tiny_pipe):
    """Real CPU tensors: with the offloader's hooks on every module (execution device = the CPU,
    so nothing is copied: the copies are checked on fake CUDA above) the images are bit-identical,
    components are activated in the order the cascade uses them, and removing the offloader
    removes every hook and leaves no instance ``forward`` behind."""
    from unclip.utils.offload import ModelOffloader

    kw = dict(num_images_per_prompt=2, output_type="pt", progress=False)
    sampling = {name: {"steps": 2} for name in tiny_pipe.stage_names}
    ref = tiny_pipe(
        "a red circle", generator=torch.Generator().manual_seed(3), sampling=sampling, **kw
    )
    tiny_pipe._null_text = None
    patched = {
        id(m) for c in tiny_pipe.modules().values() for m in c.modules() if "forward" in vars(m)
    }
    off = ModelOffloader(tiny_pipe.modules(), torch.device("cpu"))
    order = []
    activate = off.activate
    off.activate = lambda name: (order.append(name) if name != off.active else None, activate(name))
    try:
        out = tiny_pipe(
            "a red circle", generator=torch.Generator().manual_seed(3), sampling=sampling, **kw
        )
    finally:
        off.remove()
    assert torch.equal(out.images, ref.images)
    assert order[:1] == ["clip"] and order.index("prior") < order.index("decoder")
    assert [n for n in order if n.startswith("sr")] == tiny_pipe.upsampler_names
    assert not any(
        hasattr(m, "_hf_hook") for c in tiny_pipe.modules().values() for m in c.modules()
    )
    assert "encode_text" not in vars(tiny_pipe.clip)
    after = {
        id(m) for c in tiny_pipe.modules().values() for m in c.modules() if "forward" in vars(m)
    }
    assert after == patched


def test_offloading_puts_back_the_cpu_weights_without_a_copy():
    """Fake CUDA: going back to the CPU puts back each weight's own CPU parameter (no
    device-to-host copy) unless it changed on the device, which is copied back; tied weights stay
    one tensor on the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unclip.utils.offload import ModelOffloader

    with FakeTensorMode():
        net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
        net[1].weight = net[0].weight  # tied, as input and output embeddings often are
        net.register_buffer("scale", torch.ones(5))
        originals = dict(net.named_parameters()) | dict(net.named_buffers())
        off = ModelOffloader({"net": net}, torch.device("cuda", 0))
        net(torch.zeros(3, dtype=torch.long, device="cuda"))  # the hook brings the weights in
        assert off.active == "net" and off.loads == {"net": 1}
        assert net[0].weight.is_cuda and net[1].weight is net[0].weight and net.scale.is_cuda
        with torch.no_grad():
            net[1].bias.add_(1.0)  # changed on the device
        off.offload_all()
        assert net[0].weight is originals["0.weight"] and net[1].weight is net[0].weight
        assert net.scale is originals["scale"]
        assert net[1].bias.device.type == "cpu" and net[1].bias is not originals["1.bias"]
        off.activate("net")
        net.scale.data = torch.full((5,), 2.0, device="cuda")  # .data = (as peft's merge does)
        off.offload_all()
        assert net.scale is not originals["scale"] and net.scale.device.type == "cpu"
        assert net[0].weight is originals["0.weight"]
        with torch.inference_mode():  # pipelines are often called under it
            net(torch.zeros(3, dtype=torch.long, device="cuda"))
            assert off.active == "net" and not net[0].weight.is_inference()
        off.offload_all()
        assert net[0].weight is originals["0.weight"]
        off.remove()
        assert not hasattr(net, "_hf_hook")


def test_offload_api_errors_and_to(tiny_pipe):
    with pytest.raises(ValueError, match="nothing to offload"):
        tiny_pipe.enable_model_cpu_offload(device="cpu")
    with pytest.raises(ValueError, match="contradicts"):
        tiny_pipe.enable_model_cpu_offload(gpu_id=1, device="cuda:0")
    if not torch.cuda.is_available():  # a clear error, not torch's "no NVIDIA driver"
        with pytest.raises(ValueError, match="needs a CUDA GPU and torch finds none.*CPU-only"):
            tiny_pipe.enable_model_cpu_offload()
        assert tiny_pipe._offloader is None  # nothing was hooked
    from unclip.utils.offload import ModelOffloader

    shared = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="share the submodule"):
        ModelOffloader({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)}, "meta")


def test_to_while_offloading():
    """``pipe.to(dtype)`` casts the waiting CPU weights and keeps offloading; ``pipe.to(device)``
    ends it (hooks removed, everything on that device)."""
    from unclip.pipeline.tiny import tiny_pipeline
    from unclip.utils.offload import ModelOffloader

    pipe = tiny_pipeline(seed=0)
    pipe._offloader = ModelOffloader(pipe.modules(), torch.device("meta"))
    pipe._offloader.activate("decoder")
    assert pipe.device == torch.device("meta") and pipe.decoder.device.type == "meta"
    pipe.to(torch.float64)
    assert pipe.model_cpu_offload is not None and pipe.model_cpu_offload.active is None
    assert {(p.device.type, p.dtype) for p in pipe.decoder.parameters()} == {("cpu", torch.float64)}
    pipe.to("cpu")
    assert pipe.model_cpu_offload is None and pipe.device.type == "cpu"
    assert not any(hasattr(m, "_hf_hook") for c in pipe.modules().values() for m in c.modules())


def test_rerank_at_under_offload_on_fake_cuda(tmp_path):
    """The decoder's ``rerank_at`` under offload, with a decoder that encodes captions itself and
    a negative prompt: the reranking CLIP takes the GPU part-way through the decoder, which is
    brought back for the chosen candidates' remaining steps."""
    from unittest import mock

    from unclip.train.plan import _FakeCUDA
    from unclip.train.plan_sampling import _pipeline_from_configs

    cfgs = [TINY / "prior.yaml", _decoder_with_caption_transformer(tmp_path), TINY / "sr32.yaml"]
    with _FakeCUDA(), torch.no_grad(), mock.patch("torch.cuda.synchronize", lambda *a, **k: None):
        pipe = _pipeline_from_configs(cfgs)
        pipe.enable_model_cpu_offload(device="cuda:0")
        sampling = {"prior": {"steps": 2}, "decoder": {"steps": 3, "best_of": 2, "rerank_at": 1}}
        sampling["decoder"]["guidance_scale"] = 2.0
        out = pipe(
            ["a red circle", "a blue square"],
            sampling={**sampling, "sr32": {"steps": 2}},
            negative_prompt="a green square",
            output_type="pt",
            progress=False,
            return_intermediates=True,
        )
        assert out.images.shape == (2, 3, 32, 32) and out.stage_images["decoder"].shape[0] == 2
        assert pipe.model_cpu_offload.loads["decoder"] == 2  # before and after the choice
        # pruning first: the decoder comes back after each of the two choices
        pruned = {**sampling["decoder"], "best_of": 3, "prune_at": 1, "prune_keep": 2}
        out = pipe(
            ["a red circle"],
            sampling={**sampling, "decoder": {**pruned, "rerank_at": 2}, "sr32": {"steps": 2}},
            output_type="pt",
            progress=False,
        )
        assert out.images.shape == (1, 3, 32, 32) and pipe.model_cpu_offload.loads["decoder"] == 5
        # contrastive reranking on the reranking CLIP's GPU copy (its logit scale included)
        from unclip.sampling.scorers import RERANK_CONTRASTS
        from unclip.shapes.contrasts import shapes_contrast

        asked, shapes = [], shapes_contrast()
        RERANK_CONTRASTS["recording"] = lambda p: asked.append(p) or shapes(p)
        try:
            sampling["decoder"]["rerank_contrast"] = "recording"
            text = ["a red circle to the left of a blue square"]
            out = pipe(text, sampling=sampling, output_type="pt", progress=False)
        finally:
            del RERANK_CONTRASTS["recording"]
        assert asked == text and out.image_embeds.shape[0] == 1
        assert out.image_embeds.device.type == "cuda"
