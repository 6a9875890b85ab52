"""Upsampling a token pipeline's images with unCLIP upsamplers (tiny random networks, no
training), and the shapes configs of the token families (loaded only)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import token_pipeline

from unclip.nets.dvae import DVAEConfig
from unclip.nets.token_components import tokenizer_facts
from unclip.pipeline.auto import load_pipeline
from unclip.pipeline.token_pipeline import TokenPipeline
from unclip.sampling.stages import sample_upsampler
from unclip.train.token_config import (
    load_token_model_train_config,
    load_tokenizer_train_config,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a small red circle", "a blue square"]

pytestmark = pytest.mark.usefixtures("one_thread")


def gens():
    return [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]


def test_upsamplers_run_after_the_tokenizer_with_their_stored_settings(token_parts):
    pipe = token_pipeline(token_parts)
    assert pipe.upsampler_names == ["sr32", "sr64"] and pipe.resolution == 64
    settings = pipe.sampling_settings()
    assert settings["sr32"].steps == 2 and settings["sr64"].steps == 1
    assert pipe.diffusion["sr32"].prediction_type == "v_prediction"
    out = pipe(PROMPTS, generator=gens(), output_type="pt", return_intermediates=True)
    assert out.images.shape == (2, 3, 64, 64)
    assert list(out.stage_images) == ["tokenizer", "sr32", "sr64"]
    assert {"transformer", "tokenizer", "sr32", "sr64"} <= set(out.timings)
    # the same as stopping at the tokenizer, then running each upsampler on its images with the
    # same per-prompt generators carrying on
    g = gens()
    small = pipe(
        PROMPTS, generator=g, output_type="pt", last_stage="tokenizer", return_intermediates=True
    )
    assert small.images.shape == (2, 3, 16, 16) and list(small.stage_images) == ["tokenizer"]
    x = small.stage_images["tokenizer"]
    assert torch.equal(x, out.stage_images["tokenizer"])
    for name, up in zip(pipe.upsampler_names, pipe.upsamplers):
        x = sample_upsampler(up, x, settings[name], pipe.diffusion[name], generator=g)
        assert torch.equal(x, out.stage_images[name])
    assert torch.equal((x + 1) / 2, out.images)
    # per-upsampler overrides, and "upsampler" for every one
    fewer = pipe(PROMPTS, generator=gens(), output_type="pt", sampling={"sr32": {"steps": 1}})
    assert not torch.equal(fewer.images, out.images)
    assert pipe.sampling_settings({"upsampler": {"steps": 3}})["sr64"].steps == 3
    with pytest.raises(ValueError, match="'prior'"):
        pipe(PROMPTS, sampling={"prior": {"steps": 3}})


def test_a_token_pipeline_folder_keeps_its_upsamplers(token_parts, tmp_path):
    pipe = token_pipeline(token_parts)
    out = pipe(PROMPTS, generator=gens(), output_type="pt").images
    pipe.save_pretrained(tmp_path / "p")
    index = json.loads((tmp_path / "p" / "unclip.json").read_text())
    assert index["components"]["upsamplers"] == ["sr32", "sr64"]
    assert index["sampling"]["sr64"]["steps"] == 1
    assert index["diffusion"]["sr32"]["prediction_type"] == "v_prediction"
    again = load_pipeline(tmp_path / "p")
    assert again.upsampler_names == ["sr32", "sr64"]
    assert torch.equal(again(PROMPTS, generator=gens(), output_type="pt").images, out)
    # attaching upsamplers to a pipeline without them gives the same images
    attached = token_pipeline(token_parts, upsamplers=False).with_upsamplers(token_parts[1])
    assert torch.equal(attached(PROMPTS, generator=gens(), output_type="pt").images, out)


def test_upsamplers_must_chain_from_the_tokenizer_size(token_parts):
    root, ups = token_parts
    with pytest.raises(ValueError, match="reads 32 px images but gets 16 px"):
        TokenPipeline.from_components(root / "tokenizer", root / "transformer", upsamplers=ups[1:])
    with pytest.raises(TypeError, match="list of upsampler folders"):
        token_pipeline(token_parts, upsamplers=False).with_upsamplers(ups[0])


def test_a_step_callback_that_is_not_callable_is_refused_before_sampling(token_parts):
    pipe = token_pipeline(token_parts, upsamplers=False)
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    with pytest.raises(TypeError, match="^callback_on_step_end must be callable, got int$"):
        pipe(PROMPTS, generator=g, output_type="pt", callback_on_step_end=3)
    assert torch.equal(g.get_state(), before)  # not a token drawn


def test_train_tokens_config_attaches_upsamplers():
    cfg = load_token_model_train_config(
        {
            "transformer": {"type": "dalle", "dalle": {"text_vocab_size": 49408}},
            "upsamplers": ["a/sr64", "a/sr128"],
        }
    )
    assert cfg.upsamplers == ["a/sr64", "a/sr128"]
    assert load_token_model_train_config(ROOT / "configs" / "tiny" / "dalle.yaml").upsamplers == []


def test_dvae_groups_set_the_downsampling():
    cfg = DVAEConfig(image_size=32, num_codes=8, n_hid=4, blocks_per_group=1, n_init=4, groups=3)
    net = cfg.build()
    tokens = net.encode(torch.zeros(1, 3, 32, 32))
    assert cfg.grid == 8 and tokens.shape == (1, 8, 8)
    assert net.decode(tokens).shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="multiple of 4"):
        DVAEConfig(image_size=30, groups=3).build()


@pytest.mark.parametrize("family", ["dalle", "mega"])
def test_shapes_configs_load(family):
    """The shapes configs: 32 px tokenizers with 8 × 8 token grids the transformers model, the
    shipped shapes CLIP to rerank and the bundled upsamplers to 128 px."""
    kind = {"dalle": "dvae", "mega": "vqgan"}[family]
    shapes = ROOT / "configs" / "shapes"
    tok = load_tokenizer_train_config(shapes / f"{kind}.yaml")
    facts = tokenizer_facts(tok.tokenizer)
    assert facts["image_size"] == 32 and facts["grid"] == 8
    cfg = load_token_model_train_config(shapes / f"{family}.yaml")
    assert cfg.transformer.type == family
    model = cfg.transformer.model
    assert (model.grid, model.image_vocab_size) == (facts["grid"], facts["num_codes"])
    assert cfg.tokenizer == tok.train.output_dir + "/final/tokenizer"
    assert (ROOT / cfg.rerank_clip / "config.json").is_file()
    # the bundled upsamplers chain 32 → 64 → 128
    sizes = [json.loads((ROOT / u / "config.json").read_text()) for u in cfg.upsamplers]
    assert [(s["low_res_size"], s["sample_size"]) for s in sizes] == [(32, 64), (64, 128)]


def test_assemble_command_builds_a_token_pipeline_with_upsamplers(token_parts, tmp_path, capsys):
    from unclip.cli.assemble import main as assemble

    root, ups = token_parts
    argv = ["--tokenizer", str(root / "tokenizer"), "--transformer", str(root / "transformer")]
    ups_argv = [a for u in ups for a in ("--upsampler", str(u))]
    assert assemble([*argv, *ups_argv, "--out", str(tmp_path / "p")]) == 0
    assert "dalle pipeline (transformer, tokenizer, sr32, sr64; 64px)" in capsys.readouterr().out
    pipe = load_pipeline(tmp_path / "p")
    assert pipe.upsampler_names == ["sr32", "sr64"]
    out = pipe(PROMPTS, generator=gens(), output_type="pt").images
    again = token_pipeline(token_parts)(PROMPTS, generator=gens(), output_type="pt").images
    assert torch.equal(out, again)
    # and `unclip generate --model` samples through them
    from unclip.cli.generate import main as generate

    assert generate([PROMPTS[0], "--model", str(tmp_path / "p"), "--out", str(tmp_path / "g")]) == 0
    record = json.loads((tmp_path / "g" / "generate.json").read_text())
    assert record["resolution"] == 64 and {"sr32", "sr64"} <= set(record["sampling"])
    with pytest.raises(ValueError, match="--decoder belongs to unCLIP"):
        assemble([*argv, "--decoder", "d", "--out", str(tmp_path / "q")])
    with pytest.raises(ValueError, match="needs --clip and --decoder"):
        assemble(["--out", str(tmp_path / "q")])
