"""Karlo/diffusers interop: tiny random diffusers unCLIP folders built offline, loaded, converted,
exported.

The reference is diffusers' own (deprecated) ``UnCLIPPipeline``: same seed → same images (max abs
difference <= 1e-4), loading directly, through ``unclip convert`` and back through an export.
"""

# ruff: noqa: E402
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

# the imports below need transformers: skip the module without it
transformers = pytest.importorskip("transformers")

from diffusers import (
    PriorTransformer,
    UnCLIPImageVariationPipeline,
    UnCLIPScheduler,
    UNet2DConditionModel,
    UNet2DModel,
)
from diffusers import (
    UnCLIPPipeline as DiffusersUnCLIP,
)
from diffusers.pipelines.deprecated.unclip.text_proj import UnCLIPTextProjModel
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from unclip.cli import run_command
from unclip.cli.convert import main
from unclip.interop.clip import bpe_vocab
from unclip.interop.diffusers import convert
from unclip.interop.diffusers_export import export_diffusers
from unclip.interop.diffusers_import import load_diffusers_unclip
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.pipeline.tiny import tiny_latent_kwargs, tiny_pipeline

L, W, D = 16, 32, 32  # context length, text width, CLIP embedding size
STEPS = 3
PROMPTS = ["a red circle!", "Café 東京, wow!! (x) 🐱"]
PROBES = PROMPTS + [
    "",
    "it’s &amp; a   long\tprompt that will be truncated at sixteen tokens for sure ok",
]
SAMPLING = {"prior": {"steps": STEPS}, "decoder": {"steps": STEPS}, "upsampler": {"steps": STEPS}}


# ----------------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_thread")


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random offsets on every parameter, so swapped/transposed/zero-initialised weights are
    visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.eval()


def _tokenizer(pad: str) -> CLIPTokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = bpe_vocab()
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text(
            "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
        )
        return CLIPTokenizer.from_pretrained(tmp, pad_token=pad, model_max_length=L)


def _super_res(seed: int) -> UNet2DModel:
    return _perturb(
        UNet2DModel(
            sample_size=32,
            in_channels=6,
            out_channels=3,
            down_block_types=("ResnetDownsampleBlock2D",) * 2,
            up_block_types=("ResnetUpsampleBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            add_attention=False,
        ),
        seed,
    )


def build_diffusers(root: Path, variations: bool = False):
    """A Karlo-shaped diffusers unCLIP pipeline with tiny random weights, saved to ``root`` (Karlo's
    layout)."""
    torch.manual_seed(0)
    text_encoder = _perturb(
        CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=49408,
                hidden_size=W,
                intermediate_size=64,
                projection_dim=D,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=L,
                hidden_act="quick_gelu",
                pad_token_id=0,
            )
        ),
        1,
    )
    text_proj = _perturb(
        UnCLIPTextProjModel(
            clip_extra_context_tokens=4,
            clip_embeddings_dim=D,
            time_embed_dim=64,
            cross_attention_dim=32,
        ),
        2,
    )
    decoder = _perturb(
        UNet2DConditionModel(
            sample_size=16,
            in_channels=3,
            out_channels=6,
            layers_per_block=1,
            block_out_channels=(16, 32),
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
            class_embed_type="identity",
            resnet_time_scale_shift="scale_shift",
        ),
        3,
    )
    common = dict(
        decoder=decoder,
        text_encoder=text_encoder,
        tokenizer=_tokenizer("!"),
        text_proj=text_proj,
        super_res_first=_super_res(4),
        super_res_last=_super_res(5),
        decoder_scheduler=UnCLIPScheduler(variance_type="learned_range", prediction_type="epsilon"),
        super_res_scheduler=UnCLIPScheduler(
            variance_type="fixed_small_log", prediction_type="epsilon"
        ),
    )
    if variations:
        image_encoder = _perturb(
            CLIPVisionModelWithProjection(
                CLIPVisionConfig(
                    hidden_size=W,
                    intermediate_size=64,
                    projection_dim=D,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=32,
                    patch_size=8,
                    hidden_act="quick_gelu",
                )
            ),
            6,
        )
        processor = CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        pipe = UnCLIPImageVariationPipeline(
            image_encoder=image_encoder, feature_extractor=processor, **common
        )
    else:
        prior = _perturb(
            PriorTransformer(
                num_attention_heads=2,
                attention_head_dim=16,
                num_layers=2,
                embedding_dim=D,
                num_embeddings=L,
                additional_embeddings=4,
            ),
            7,
        )
        with torch.no_grad():
            prior.clip_std.copy_(torch.rand(1, D) + 0.5)
            prior.clip_mean.copy_(torch.randn(1, D) * 0.1)
        pipe = DiffusersUnCLIP(
            prior=prior,
            prior_scheduler=UnCLIPScheduler(
                variance_type="fixed_small_log", prediction_type="sample", clip_sample_range=5.0
            ),
            **common,
        )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(str(root), safe_serialization=True)
    index = json.loads((root / "model_index.json").read_text())
    index["text_proj"] = ["unclip", "UnCLIPTextProjModel"]  # as in kakaobrain/karlo-v1-alpha
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return pipe


@pytest.fixture(scope="module")
def karlo(tmp_path_factory):
    root = tmp_path_factory.mktemp("karlo")
    return root, build_diffusers(root)


@pytest.fixture(scope="module")
def reference(karlo):
    """diffusers' images ``[N, 3, H, W]`` in [0, 1] for PROMPTS × 2 images, seed 0."""
    return _diffusers_images(karlo[1])


@pytest.fixture(scope="module")
def loaded(karlo):
    """The tiny Karlo folder loaded directly by ``UnCLIPPipeline.from_pretrained``, in full
    precision (diffusers' arithmetic; the default autocast is bf16 on CPUs that run it natively)
    and the default channels-last layout."""
    return UnCLIPPipeline.from_pretrained(karlo[0], autocast_dtype=None)


@pytest.fixture
def folder(karlo, tmp_path):
    """A private copy of the tiny Karlo folder to break."""
    return Path(shutil.copytree(karlo[0], tmp_path / "karlo"))


def _diffusers_images(dpipe, seed: int = 0) -> torch.Tensor:
    out = dpipe(
        PROMPTS,
        num_images_per_prompt=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        prior_num_inference_steps=STEPS,
        decoder_num_inference_steps=STEPS,
        super_res_num_inference_steps=STEPS,
    ).images
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def _unclip_images(pipe: UnCLIPPipeline, seed: int = 0) -> torch.Tensor:
    return pipe(
        PROMPTS,
        num_images_per_prompt=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        sampling=SAMPLING,
        progress=False,
    ).images


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


# ------------------------------------------------------------------------------------------ import
def test_tokenizer_and_text_encoder_match_transformers(karlo, loaded):
    root, dpipe = karlo
    pipe = loaded
    tok = CLIPTokenizer.from_pretrained(str(root / "tokenizer"))
    for (
        probe
    ) in PROBES:  # Karlo pads with "!" (id 0), which transformers also splits out of prompts
        enc = tok(probe, padding="max_length", max_length=L, truncation=True, return_tensors="pt")
        assert pipe.clip.tokenize([probe], warn=False).tolist() == enc.input_ids.tolist(), probe
        text = pipe.encode_text(probe)
        assert text.text_mask.tolist() == enc.attention_mask.bool().tolist(), probe
        with torch.no_grad():
            ref = dpipe.text_encoder(enc.input_ids)
        # raw, not normalised
        torch.testing.assert_close(text.text_embed, ref.text_embeds, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(text.text_tokens, ref.last_hidden_state, atol=1e-5, rtol=1e-5)


def test_load_samples_like_diffusers(karlo, loaded, reference, tmp_path, capsys):
    root, _ = karlo
    direct = loaded
    assert direct.stage_names == ["prior", "decoder", "sr32"]
    assert direct.prior_clip_range == 5.0
    # an upsampler's settings have no candidates (best_of) at all
    assert {
        k: (s.scheduler, s.steps, s.guidance_scale, getattr(s, "best_of", None))
        for k, s in direct.sampling.items()
    } == {
        "prior": ("unclip", 25, 4.0, 1),
        "decoder": ("unclip", 25, 8.0, 1),
        "sr32": ("unclip", 7, 1.0, None),
    }
    assert _max_diff(_unclip_images(direct), reference) <= 1e-4

    assert main([str(root), str(tmp_path / "native")]) == 0
    assert "wrote unclip pipeline" in capsys.readouterr().out
    native = UnCLIPPipeline.from_pretrained(tmp_path / "native", autocast_dtype=None)
    assert native.prior_clip_range == 5.0 and native.clip.has_vision is False
    assert _max_diff(_unclip_images(native), reference) <= 1e-4


def test_a_diffusers_users_script_matches_diffusers_with_the_defaults(karlo, reference):
    """A script as a diffusers user writes it: flat keywords, float ``np`` output,
    ``return_dict=False``, ``set_progress_bar_config``, ``components`` and ``from_pipe``, on the
    Karlo-layout folder loaded with the defaults (no autocast asked for: exact, as diffusers)."""
    pipe = UnCLIPPipeline.from_pretrained(karlo[0])
    assert pipe.autocast_dtype is None  # nothing faster than the weights' dtype unless asked
    pipe.set_progress_bar_config(disable=True)
    steps = dict(
        prior_num_inference_steps=STEPS,
        decoder_num_inference_steps=STEPS,
        super_res_num_inference_steps=STEPS,
    )
    seed = torch.Generator().manual_seed
    (images,) = pipe(
        PROMPTS, num_images_per_prompt=2, **steps, generator=seed(0), output_type="np",
        return_dict=False,
    )  # fmt: skip
    assert images.dtype == np.float32 and images.shape[-1] == 3
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert _max_diff(torch.from_numpy(images).permute(0, 3, 1, 2), reference) <= 1e-4
    assert {"clip", "prior", "decoder", "sr32"} <= set(pipe.modules())
    assert UnCLIPPipeline(**pipe.components).modules()["sr32"] is pipe.modules()["sr32"]
    again = UnCLIPPipeline.from_pipe(pipe)
    assert again.decoder is pipe.decoder  # shared, not copied
    out = again(PROMPTS, num_images_per_prompt=2, **steps, generator=seed(0), output_type="np")
    assert np.array_equal(out[0], images) and np.array_equal(out["images"], images)
    with pytest.raises(ValueError, match="disagree"):
        pipe(PROMPTS, decoder_num_inference_steps=2, sampling={"decoder": {"steps": 3}})
    with pytest.raises(ValueError, match="use_safetensors=False"):
        UnCLIPPipeline.from_pretrained(karlo[0], use_safetensors=False)


def test_export_samples_like_diffusers(karlo, reference, tmp_path, capsys):
    root, _ = karlo  # diffusers folder → unclip → diffusers folder
    assert main([str(root), str(tmp_path / "exported"), "--to", "diffusers"]) == 0
    assert "wrote diffusers UnCLIPPipeline" in capsys.readouterr().out
    for config in (tmp_path / "exported").rglob("*.json"):  # no path of the writing machine
        assert str(root) not in config.read_text() and str(tmp_path) not in config.read_text()
    exported = DiffusersUnCLIP.from_pretrained(str(tmp_path / "exported"))  # diffusers' own loader
    exported.set_progress_bar_config(disable=True)
    assert exported.prior_scheduler.config.clip_sample_range == 5.0
    assert exported.decoder_scheduler.config.variance_type == "learned_range"
    assert _max_diff(_diffusers_images(exported), reference) <= 1e-4
    again = UnCLIPPipeline.from_pretrained(tmp_path / "exported", autocast_dtype=None)  # back
    assert _max_diff(_unclip_images(again), reference) <= 1e-4


def test_a_karlo_repo_loads_and_converts_by_hub_id(karlo, reference, hub_cache, tmp_path, capsys):
    repo = shutil.copytree(karlo[0], tmp_path / "karlo")
    card = "---\nlicense: creativeml-openrail-m\ntags:\n- text-to-image\n---\n\n# Karlo\n"
    (repo / "README.md").write_text(card)
    hub_cache("kakaobrain/karlo-tiny", repo)  # offline: from the Hub cache only
    pipe = UnCLIPPipeline.from_pretrained("kakaobrain/karlo-tiny", autocast_dtype=None)
    assert _max_diff(_unclip_images(pipe), reference) <= 1e-4
    assert main(["kakaobrain/karlo-tiny", str(tmp_path / "native")]) == 0
    assert "wrote unclip pipeline" in capsys.readouterr().out
    written = ModelCard.load(tmp_path / "native" / "README.md").data
    assert written.license == "creativeml-openrail-m"  # the source's license is kept
    assert written.base_model == "kakaobrain/karlo-tiny" and written.library_name == "unclip"
    assert (
        run_command("convert", ["kakaobrain/karlo-tiny", str(tmp_path / "v"), "--revision", "v9"])
        == 1
    )
    assert "kakaobrain/karlo-tiny (revision v9)" in capsys.readouterr().err


def test_image_variations_layout(tmp_path):
    dpipe = build_diffusers(tmp_path / "var", variations=True)
    pipe = UnCLIPPipeline.from_pretrained(tmp_path / "var", autocast_dtype=None)
    assert pipe.prior is None and pipe.clip.has_vision
    # no temperature in transformers' encoders: OpenAI's trained value, which reranking reads
    assert pipe.clip.logit_scale == pytest.approx(100.0)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = dpipe.image_encoder(pixels).image_embeds
        ours = pipe.clip.model.encode_image(pixels)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    embeds = ref
    expected = dpipe(
        image_embeddings=embeds,
        decoder_num_inference_steps=STEPS,
        super_res_num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    gen = torch.Generator().manual_seed(0)
    small = pipe.decode(embeds, None, gen, SAMPLING, progress=False)
    big = pipe.upsample(small, gen, SAMPLING, progress=False)
    assert _max_diff((big + 1) / 2, torch.from_numpy(expected).permute(0, 3, 1, 2)) <= 1e-4


def test_text_to_image_clip_refuses_to_embed_images(loaded):
    pipe = loaded
    with pytest.raises(ValueError, match="no image-tower weights.*image_encoder"):
        pipe.clip.encode_image(torch.zeros(1, 3, 32, 32))


# ---------------------------------------------------------------------------------------- bad input
def test_missing_component_folder(folder):
    shutil.rmtree(folder / "super_res_last")
    with pytest.raises(ValueError, match="super_res_last: component folder .* is missing"):
        UnCLIPPipeline.from_pretrained(folder)


def test_missing_and_extra_components_in_index(folder):
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(
        json.dumps({**index, "safety_checker": ["diffusers", "X"]})
    )
    with pytest.raises(ValueError, match="unexpected component 'safety_checker'"):
        load_diffusers_unclip(folder)
    del index["prior_scheduler"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="prior_scheduler: component is missing"):
        load_diffusers_unclip(folder)


def test_not_an_unclip_folder(folder, tmp_path, capsys):
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "StableDiffusionPipeline"})
    )
    with pytest.raises(
        ValueError, match="not a diffusers unCLIP pipeline.*StableDiffusionPipeline"
    ):
        UnCLIPPipeline.from_pretrained(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not an unclip pipeline folder"):
        UnCLIPPipeline.from_pretrained(tmp_path / "empty")
    assert run_command("convert", [str(tmp_path / "empty"), str(tmp_path / "out")]) == 1
    assert "no model_index.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_names_component_and_key(folder):
    file = folder / "decoder" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    state["conv_in.weight"] = torch.zeros(16, 3, 5, 5)
    save_file(state, str(file))
    with pytest.raises(
        ValueError, match=r"decoder: weight 'conv_in.weight' has shape \(16, 3, 5, 5\)"
    ):
        load_diffusers_unclip(folder)


def test_weight_missing_or_unexpected_names_component_and_key(folder):
    file = folder / "text_proj" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    del state["embedding_proj.bias"]
    save_file(state, str(file))
    with pytest.raises(ValueError, match="text_proj: weight 'embedding_proj.bias' is missing"):
        load_diffusers_unclip(folder)
    file = folder / "text_encoder" / "model.safetensors"
    save_file({**load_file(str(file)), "text_model.extra.weight": torch.zeros(2)}, str(file))
    with pytest.raises(
        ValueError, match="text_encoder: unexpected weight 'text_model.extra.weight'"
    ):
        load_diffusers_unclip(folder)


def test_unsupported_config_names_component_and_key(folder):
    cfg_file = folder / "super_res_first" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    (cfg_file).write_text(json.dumps({**cfg, "class_embed_type": "timestep"}))
    with pytest.raises(ValueError, match="super_res_first: config class_embed_type = 'timestep'"):
        load_diffusers_unclip(folder)
    cfg_file.write_text(json.dumps(cfg))
    sched = folder / "decoder_scheduler" / "scheduler_config.json"
    sched.write_text(
        json.dumps({**json.loads(sched.read_text()), "variance_type": "fixed_small_log"})
    )
    with pytest.raises(
        ValueError, match="decoder_scheduler: config variance_type = 'fixed_small_log'"
    ):
        load_diffusers_unclip(folder)


def test_foreign_tokenizer_is_refused(folder):
    for f in (folder / "tokenizer").iterdir():
        f.unlink()
    vocab, merges = bpe_vocab()
    vocab = dict(vocab)
    vocab["a</w>"], vocab["b</w>"] = vocab["b</w>"], vocab["a</w>"]
    (folder / "tokenizer" / "vocab.json").write_text(json.dumps(vocab))
    (folder / "tokenizer" / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    with pytest.raises(ValueError, match="tokenizer: vocabulary differs"):
        load_diffusers_unclip(folder)


def test_pickle_weights_are_refused(folder):
    weights = folder / "prior" / "diffusion_pytorch_model.safetensors"
    weights.rename(folder / "prior" / "diffusion_pytorch_model.bin")
    with pytest.raises(ValueError, match="prior: no safetensors weights.*pickle"):
        load_diffusers_unclip(folder)


class _Payload:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("component", ["prior", "decoder", "text_encoder", "super_res_first"])
def test_malicious_pickle_weights_are_refused_unrun(folder, tmp_path, component):
    for weights in (folder / component).glob("*.safetensors"):
        weights.unlink()
    name = "pytorch_model.bin" if component == "text_encoder" else "diffusion_pytorch_model.bin"
    bad = folder / component / name
    torch.save({"payload": _Payload(tmp_path / "marker")}, bad)
    with pytest.raises(
        ValueError, match=rf"{component}: no safetensors weights.*{bad} is a pickle"
    ):
        UnCLIPPipeline.from_pretrained(folder)
    assert not (tmp_path / "marker").exists()


# ------------------------------------------------------------------------------- export errors, CLI
def test_export_refuses_what_diffusers_cannot_express(tmp_path):
    pipe = tiny_pipeline(
        clip_kwargs=dict(width=48),  # text width 48 != CLIP embedding 32, two upsamplers, ...
        decoder_kwargs=dict(coord_channels=True, embed_scale=8.0, **tiny_latent_kwargs()),
    )
    with pytest.raises(ValueError) as err:
        export_diffusers(pipe, tmp_path / "out")
    msg = str(err.value)
    for part in (
        "clip: normalize_embeds=True",
        "prior: text_token_proj",
        "decoder: text tokens are 48 wide",
        "decoder: a latent decoder (over a frozen VQModel)",
        "decoder: coord_channels=True",
        "decoder: embed_scale=8.0",
        "decoder: learned_variance=False",
        "exactly one upsampling stage",
        "sr32: noise-level conditioning",
        "sr64: noise-level conditioning",
    ):
        assert part in msg
    assert not (tmp_path / "out").exists()


def test_export_names_the_single_problem(loaded, tmp_path):
    loaded.clip.normalize_embeds = True
    try:
        with pytest.raises(
            ValueError,
            match=r"diffusers UnCLIPPipeline:\n  - clip: normalize_embeds=True[^\n]*\n"
            r"cannot export: none; exports as is: text_encoder, prior, decoder, super_res[^\n]*$",
        ):
            export_diffusers(loaded, tmp_path / "out")
    finally:
        loaded.clip.normalize_embeds = False
    assert not (tmp_path / "out").exists()


def test_cli_errors(karlo, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # an argparse usage error keeps its status 2
        main([str(karlo[0]), str(tmp_path / "x"), "--to", "karlo"])
    assert e.value.code == 2
    capsys.readouterr()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep")
    # a user error is one line and status 1, as the README promises, not the usage and status 2
    assert run_command("convert", [str(karlo[0]), str(tmp_path / "busy")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("unclip convert: error: ") and err.count("\n") == 1, err
    assert "--overwrite" in err and "usage:" not in err
    assert (tmp_path / "busy" / "file").read_text() == "keep"
    # a native unclip folder cannot be exported: this one normalises embeddings
    tiny_pipeline().save_pretrained(tmp_path / "native")
    argv = [str(tmp_path / "native"), str(tmp_path / "out"), "--to", "diffusers"]
    assert run_command("convert", argv) == 1
    err = capsys.readouterr().err
    assert "cannot export" in err and err.count("\n") == 1


def test_convert_library_call_checks_its_arguments(karlo, tmp_path):
    with pytest.raises(ValueError, match="to must be 'unclip' or 'diffusers'"):
        convert(karlo[0], tmp_path / "x", to="karlo")
    with pytest.raises(FileNotFoundError, match="source folder not found"):
        convert(tmp_path / "missing", tmp_path / "x")
    with pytest.raises(ValueError, match="must differ"):
        convert(karlo[0], karlo[0], overwrite=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("keep")
    with pytest.raises(ValueError, match="--overwrite"):
        convert(karlo[0], tmp_path / "busy")
    pipe = convert(karlo[0], tmp_path / "busy", overwrite=True)
    assert (tmp_path / "busy" / "file").read_text() == "keep"
    again = UnCLIPPipeline.from_pretrained(tmp_path / "busy")
    assert again.stage_names == pipe.stage_names


def test_convert_takes_the_bundled_name_and_exports_its_exportable_parts(tmp_path, capsys):
    # `generate` and `serve` take "shapes"; convert does too (it is no diffusers folder, so --to
    # unclip is refused for what the folder is, not as "not found")
    assert run_command("convert", ["shapes", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "no model_index.json" in err and "not found" not in err
    # the whole cascade cannot be expressed; the error says which parts can and how to write them
    assert run_command("convert", ["shapes", str(tmp_path / "d"), "--to", "diffusers"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot export: decoder, super_res; exports as is: text_encoder, prior" in err
    assert "--parts text_encoder,prior" in err
    argv = ["shapes", str(tmp_path / "d"), "--to", "diffusers", "--parts", "decoder"]
    assert run_command("convert", argv) == 1
    assert "coord_channels" in capsys.readouterr().err
    argv = ["shapes", str(tmp_path / "d"), "--to", "diffusers", "--parts", "text_encoder,prior"]
    assert run_command("convert", argv) == 0
    out = tmp_path / "d"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "prior",
        "prior_scheduler",
        "text_encoder",
        "tokenizer",
    ]
    note = json.loads((out / "unclip_export.json").read_text())
    assert note["not_exported"] == ["decoder", "super_res"]
    assert "normalize_embeds" in note["conventions"][0]
    pipe = UnCLIPPipeline.from_pretrained("shapes", autocast_dtype=None)
    prior = PriorTransformer.from_pretrained(out / "prior")
    for key, value in pipe.prior.transformer.state_dict().items():
        assert torch.equal(prior.state_dict()[key], value), key
    text_encoder = CLIPTextModelWithProjection.from_pretrained(out / "text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    prompt = ["a red circle above a blue square"]
    ids = tokenizer(prompt, padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = torch.nn.functional.normalize(text_encoder(ids).text_embeds, dim=-1)
    ours = pipe.clip.encode_text(prompt).text_embed  # the bundled CLIP normalises
    assert (theirs - ours).abs().max() < 1e-5
