"""The pipeline base every family stands on (unclip.pipeline.base): components that rebuild the
pipeline, settings resolved once per call, the upsampler chain by name, save_pretrained's
diffusers keywords, the token family on the same surface, and the public import paths."""

import warnings
from unittest import mock

import pytest
import torch
from conftest import gens, token_pipeline

from unclip.pipeline.tiny import tiny_pipeline

FEW = {"prior": {"steps": 2}, "decoder": {"steps": 2}, "upsampler": {"steps": 1}}
PROMPTS = ["a red circle", "a blue square"]


def images(pipe, **kw):
    kw.setdefault("sampling", FEW)
    return pipe(PROMPTS, generator=gens(0, 1), output_type="pt", progress=False, **kw).images


def test_components_rebuild_the_pipeline_and_from_pipe_shares_the_modules(tiny_pipe):
    from unclip import UnCLIPPipeline

    rebuilt = UnCLIPPipeline(**tiny_pipe.components)
    assert rebuilt.modules().keys() == tiny_pipe.modules().keys()
    assert all(rebuilt.modules()[k] is m for k, m in tiny_pipe.modules().items())
    assert torch.equal(images(rebuilt), images(tiny_pipe))
    fewer = UnCLIPPipeline.from_pipe(tiny_pipe, upsamplers=tiny_pipe.upsamplers[:1])
    assert fewer.stage_names == ["prior", "decoder", "sr32"] and fewer.decoder is tiny_pipe.decoder
    with pytest.raises(TypeError, match="unknown argument 'decoderr'"):
        UnCLIPPipeline.from_pipe(tiny_pipe, decoderr=None)


def test_a_call_resolves_the_settings_once(tiny_pipe):
    """Every stage of every candidate group reads the settings the call resolved: one
    resolution per call, whatever the number of upsamplers and groups (best_of_contrasted makes
    two groups here)."""
    import unclip.pipeline.cascade as module

    real = module.resolve_sampling
    sampling = {**FEW, "decoder": {"steps": 2, "best_of": 2, "best_of_contrasted": 3,
                                   "rerank_contrast": "shapes"}}  # fmt: skip
    with mock.patch.object(module, "resolve_sampling", side_effect=real) as counted:
        images(tiny_pipe, sampling=sampling)
        assert counted.call_count == 1
        tiny_pipe.upsample(torch.zeros(1, 3, 16, 16), gens(0), FEW, progress=False)
        assert counted.call_count == 2  # a stage method called alone resolves its own


def test_upsample_runs_the_named_stages_only(tiny_pipe):
    small = torch.zeros(1, 3, 16, 16)
    out, inter = tiny_pipe.upsample(
        small, gens(0), FEW, stages=["sr32"], return_intermediates=True, progress=False
    )
    assert out.shape == (1, 3, 32, 32) and list(inter) == ["sr32"]
    with pytest.raises(ValueError, match="no upsampler 'sr128'; this pipeline has sr32, sr64"):
        tiny_pipe.upsample(small, stages=["sr128"])
    with pytest.raises(TypeError, match="a list of stage names"):
        tiny_pipe.upsample(small, stages="sr32")


def test_save_pretrained_variant_and_safe_serialization(tiny_pipe, tmp_path):
    from unclip import UnCLIPPipeline

    tiny_pipe.save_pretrained(tmp_path / "v", variant="fp16")
    names = sorted(p.name for p in (tmp_path / "v").rglob("*.safetensors"))
    assert names and all(n.endswith(".fp16.safetensors") for n in names)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        UnCLIPPipeline.from_pretrained(tmp_path / "v")  # the plain weights are not there
    # a variant saved into a folder with the plain weights leaves them there (diffusers' layout)
    tiny_pipe.save_pretrained(tmp_path / "both")
    tiny_pipe.save_pretrained(tmp_path / "both", variant="fp16")
    both = sorted(p.name for p in (tmp_path / "both" / "decoder").glob("*.safetensors"))
    assert len(both) == 2 and any(".fp16." in n for n in both)
    assert not list((tmp_path / "both").rglob("*.fp16.fp16.*"))
    UnCLIPPipeline.from_pretrained(tmp_path / "both", memory_format=None)
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "v", variant="fp16", memory_format=None)
    assert torch.equal(images(loaded), images(tiny_pipe))
    assert all(not p.requires_grad for m in loaded.modules().values() for p in m.parameters())
    with pytest.raises(ValueError, match="safetensors only"):
        tiny_pipe.save_pretrained(tmp_path / "p", safe_serialization=False)
    with pytest.raises(ValueError, match="variant must be a short name"):
        tiny_pipe.save_pretrained(tmp_path / "w", variant="../x")
    with pytest.raises(TypeError, match="push_to_hub=True"):
        tiny_pipe.save_pretrained(tmp_path / "x", repo_id="me/x")


def test_progress_bar_config_reaches_the_edits(capsys):
    pipe = tiny_pipeline(seed=0)
    pipe.set_progress_bar_config(disable=True)
    from PIL import Image

    picture = Image.new("RGB", (64, 64), (200, 40, 40))
    pipe.variations(picture, num_images=1, generator=gens(0), sampling=FEW)
    assert "it/s" not in capsys.readouterr().err
    pipe.set_progress_bar_config(disable=False)
    pipe.variations(picture, num_images=1, generator=gens(0), sampling=FEW)
    assert "it/s" in capsys.readouterr().err


def test_the_token_pipeline_stands_on_the_base(token_parts, tmp_path):
    """A loaded token pipeline is frozen; it takes prompt= (prompts= with a FutureWarning),
    return_dict, one generator per image, output_type checks, a real autocast around its
    transformer, .to(dtype), and components/from_pipe/save_pretrained of the base."""
    from unclip.pipeline import BasePipeline, TokenPipeline, is_pipeline

    pipe = token_pipeline(token_parts)
    assert isinstance(pipe, BasePipeline) and is_pipeline(pipe)
    assert all(not p.requires_grad for m in pipe.modules().values() for p in m.parameters())
    few = {"upsampler": {"steps": 1}}
    kw = {"sampling": few, "output_type": "pt", "progress": False}
    one = pipe(prompt="a red circle", generator=gens(0), **kw).images
    with pytest.warns(FutureWarning, match="prompt"):
        again = pipe(prompts="a red circle", generator=gens(0), **kw).images
    assert torch.equal(one, again)
    (tup,) = pipe("a red circle", generator=gens(0), return_dict=False, **kw)
    assert torch.equal(tup, one)
    per_image = pipe("a red circle", 2, generator=gens(0, 1), **kw).images
    # the first image draws from its own generator as alone (batch-size rounding in the UNets)
    torch.testing.assert_close(per_image[:1], one, atol=1e-5, rtol=0)
    assert (per_image[1:] - one).abs().max() > 1e-2
    with pytest.raises(ValueError, match="output_type must be one of"):
        pipe("a red circle", output_type="jpeg")

    seen = []
    # sampling calls the transformer's start/step, which run its layers
    layer = next(m for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear))
    hook = layer.register_forward_pre_hook(
        lambda m, a: seen.append(torch.is_autocast_enabled("cpu"))
    )
    try:
        pipe("a", generator=gens(0), last_stage="tokenizer", output_type="pt")
        pipe.autocast_dtype = torch.bfloat16
        assert pipe.autocast_dtype == torch.bfloat16 and pipe.autocast_setting == torch.bfloat16
        pipe("a", generator=gens(0), last_stage="tokenizer", output_type="pt")
    finally:
        hook.remove()
        pipe.autocast_dtype = None
    assert seen and not any(seen[: len(seen) // 2]) and all(seen[len(seen) // 2 :])

    rebuilt = TokenPipeline(**pipe.components)
    assert torch.equal(rebuilt(prompt="a red circle", generator=gens(0), **kw).images, one)
    pipe.save_pretrained(tmp_path / "tok", model_card={"license": "mit"})
    loaded = TokenPipeline.from_pretrained(tmp_path / "tok", torch_dtype=torch.bfloat16)
    assert (
        loaded.dtype == torch.bfloat16
        and "**License:** mit" in (tmp_path / "tok" / "README.md").read_text()
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'revision'"):
        TokenPipeline.from_pretrained(tmp_path / "tok", revision="main")
    with pytest.raises(ValueError, match="loads plain weights only"):
        pipe.save_pretrained(tmp_path / "tok16", variant="fp16")
    with pytest.raises(ValueError, match="training would be dropped"):
        pipe.save_pretrained(tmp_path / "tok2", model_card={"training": "shapes"})
    assert not hasattr(pipe, "load_lora")  # a capability it lacks is absent, not stubbed


def test_public_import_paths_need_no_compat():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from unclip import AutoPipeline, BasePipeline, TokenPipeline, load_pipeline  # noqa: F401
        from unclip.pipeline import KandinskyPipeline, UnCLIPPipeline  # noqa: F401
    assert issubclass(UnCLIPPipeline, BasePipeline) and issubclass(KandinskyPipeline, BasePipeline)
    assert issubclass(TokenPipeline, BasePipeline)


def test_from_pipe_refuses_shared_modules_with_offload_hooks(tiny_pipe):
    from unclip import UnCLIPPipeline

    pipe = UnCLIPPipeline(**tiny_pipe.components)
    pipe._sequential_device = torch.device("cuda", 0)  # as enable_sequential_cpu_offload leaves it
    with pytest.raises(ValueError, match="CPU offload on"):
        UnCLIPPipeline.from_pipe(pipe)


def test_a_token_pipeline_loads_from_a_hub_id(token_parts, hub_cache, tmp_path):
    from unclip.pipeline import TokenPipeline, load_pipeline

    token_pipeline(token_parts, upsamplers=False).save_pretrained(tmp_path / "tok")
    hub_cache("org/tiny-dalle", tmp_path / "tok")
    loaded = load_pipeline("org/tiny-dalle")
    assert isinstance(loaded, TokenPipeline) and loaded.family == "dalle"
