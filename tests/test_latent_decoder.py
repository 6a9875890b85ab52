"""Latent decoders in native pipelines: a decoder whose diffusion runs on a frozen autoencoder's
latents (a train-tokenizer VQGAN, a diffusers VQModel or AutoencoderKL), trained with
train-decoder and sampled, reranked and edited by the one pipeline."""

import json
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS
from safetensors.torch import load_file

from unclip.cli import train_decoder
from unclip.nets.autoencoder import LatentSpace, load_autoencoder
from unclip.nets.config import DecoderConfig
from unclip.nets.decoder import UnCLIPDecoder
from unclip.nets.dvae import DVAEConfig
from unclip.nets.lora import adaptable_names, add_adapter
from unclip.nets.token_components import TokenizerConfig, save_component
from unclip.nets.vqgan import VQGANConfig
from unclip.pipeline.pipeline import UnCLIPPipeline
from unclip.pipeline.tiny import tiny_latent_kwargs, tiny_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"decoder": {"steps": 4}, "sr32": {"steps": 2}}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def picture(size=16, seed=0):
    g = gen(seed)
    x = torch.zeros(1, 3, size, size)
    x[:, 0] = 0.8
    x[:, :, 2:8, 3:9] = torch.rand(3, 1, 1, generator=g) * 2 - 1
    return x


@pytest.fixture(scope="module", params=["VQModel", "AutoencoderKL"])
def pipe(request):
    return tiny_pipeline(0, sizes=(16, 32), decoder_kwargs=tiny_latent_kwargs(request.param))


@pytest.fixture(scope="module")
def vqgan_folder(tmp_path_factory):
    """A random tiny train-tokenizer VQGAN folder (16 px, f4, cosine codes)."""
    cfg = TokenizerConfig(
        type="vqgan",
        vqgan=VQGANConfig(
            image_size=16,
            block_out_channels=(16, 16, 32),
            layers_per_block=1,
            latent_channels=4,
            num_codes=32,
            norm_num_groups=8,
            l2_codes=True,
        ),
    )
    torch.manual_seed(0)
    return save_component(cfg.build(), tmp_path_factory.mktemp("vq") / "tok", "tokenizer", cfg)


def test_the_decoder_samples_latents_and_decodes_them(pipe):
    d = pipe.decoder
    assert d.is_latent and d.sample_shape == (4, 4, 4)
    assert d.unet.config.sample_size == 4 and d.unet.config.in_channels == 4
    emb = torch.nn.functional.normalize(
        torch.randn(2, pipe.clip.embed_dim, generator=gen()), dim=-1
    )
    z = torch.randn(2, *d.sample_shape, generator=gen(1))
    a = pipe.decode(emb, ["a red circle"] * 2, sampling=FAST, latents=z, progress=False)
    assert a.shape == (2, 3, 16, 16) and a.min() >= -1 and a.max() <= 1
    # the same latents give the same images; the autoencoder's decoder makes them
    assert torch.equal(
        a, pipe.decode(emb, ["a red circle"] * 2, sampling=FAST, latents=z, progress=False)
    )
    conv = d.latent_space.model.decoder.conv_out
    saved = conv.bias.detach().clone()
    try:
        with torch.no_grad():
            conv.bias.add_(0.3)
        b = pipe.decode(emb, ["a red circle"] * 2, sampling=FAST, latents=z, progress=False)
    finally:
        with torch.no_grad():
            conv.bias.copy_(saved)
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="latents"):
        pipe.decode(
            emb, ["x"] * 2, sampling=FAST, latents=torch.randn(2, 3, 16, 16), progress=False
        )


def test_the_whole_cascade_reranks_a_latent_decoders_candidates(pipe):
    out = pipe(
        ["a red circle", "a blue square"],
        generator=gen(),
        output_type="pt",
        progress=False,
        sampling={**FAST, "decoder": {"steps": 4, "best_of": 3}},
    )
    assert out.images.shape == (2, 3, 32, 32)
    # choosing among predicted images at step 2 scores decoded latents, and keeps one per image
    early = pipe(
        ["a red circle"],
        generator=gen(),
        output_type="pt",
        progress=False,
        sampling={**FAST, "decoder": {"steps": 4, "best_of": 3, "rerank_at": 2}},
        return_intermediates=True,
    )
    assert early.images.shape == (1, 3, 32, 32)
    assert early.stage_images["decoder"].shape == (1, 3, 16, 16)


def test_the_folder_keeps_the_autoencoder_and_loads_it_frozen(pipe, tmp_path):
    pipe.decoder.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["autoencoder"]["_class_name"] == pipe.decoder.latent_space.kind
    back = UnCLIPDecoder.from_pretrained(tmp_path)
    mine, theirs = pipe.decoder.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert any(k.startswith("latent_space.") for k in theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not any(p.requires_grad for p in back.latent_space.parameters())
    back.train()
    assert back.unet.training and not back.latent_space.training
    # a whole pipeline folder: the same images after loading
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = UnCLIPPipeline.from_pretrained(tmp_path / "pipe")
    assert loaded.decoder.is_latent
    emb = torch.nn.functional.normalize(
        torch.randn(1, pipe.clip.embed_dim, generator=gen()), dim=-1
    )
    z = torch.randn(1, *pipe.decoder.sample_shape, generator=gen(1))
    kw = dict(sampling=FAST, latents=z, progress=False)
    torch.testing.assert_close(
        loaded.decode(emb, ["a red circle"], **kw), pipe.decode(emb, ["a red circle"], **kw)
    )


def test_lora_leaves_the_autoencoder_alone(pipe):
    d = tiny_pipeline(0, sizes=(16,), decoder_kwargs=tiny_latent_kwargs("VQModel")).decoder
    assert "to_q" in adaptable_names(d.unet)  # the UNet's attention is adapted by default
    # and the autoencoder's mid-block attention has layers of the same names
    assert any(n.endswith("to_q") for n, _ in d.latent_space.named_modules())
    add_adapter(d, "style", rank=2, trainable=True)
    adapted = {n for n, p in d.named_parameters() if "lora_" in n}
    assert adapted and not any(n.startswith("latent_space.") for n in adapted)
    assert not any(p.requires_grad for p in d.latent_space.parameters())
    # an adapter config that excludes layers of its own still leaves the autoencoder out
    import peft

    own = peft.LoraConfig(r=2, target_modules=["to_q", "to_k"], exclude_modules=["to_k"])
    add_adapter(d, "other", rank=2, config=own)
    names = [n for n, _ in d.named_modules() if n.endswith("lora_A.other")]
    assert names and not any(n.startswith("latent_space.") or ".to_k." in n for n in names)


def test_inpainting_keeps_the_unmasked_pixels_exactly(pipe):
    x = picture()
    mask = torch.zeros(1, 1, 16, 16)
    mask[..., :, :8] = 1
    out = pipe.inpaint(
        x, mask, "a red circle", sampling=FAST, output_type="pt", progress=False,
        return_intermediates=True, generator=gen(),
    )  # fmt: skip
    small = out.stage_images["decoder"]
    assert torch.equal(small[..., 8:], x[..., 8:])
    assert not torch.equal(small[..., :8], x[..., :8])


def test_img2img_starts_from_the_images_latents(pipe):
    def decoded(x, strength):
        out = pipe.img2img(
            x, "a red circle", strength=strength, sampling=FAST, output_type="pt",
            progress=False, generator=gen(), return_intermediates=True,
        )  # fmt: skip
        return out.stage_images["decoder"]

    a, b = picture(seed=1), picture(seed=2)
    assert decoded(a, 0.25).shape == (1, 3, 16, 16)
    # from the images' latents a quarter of the way, the two results keep the images' difference;
    # from pure noise (strength 1) they barely depend on the image
    weak = (decoded(a, 0.25) - decoded(b, 0.25)).abs().mean()
    full = (decoded(a, 1.0) - decoded(b, 1.0)).abs().mean()
    assert weak > 10 * full


def test_inversion_and_text_diffs_run_on_the_latents(pipe):
    kind = pipe.decoder.latent_space.kind
    small = tiny_pipeline(0, sizes=(16,), decoder_kwargs=tiny_latent_kwargs(kind))
    x = picture()
    inv = small.invert(x, steps=6, progress=False)
    assert inv.latents.shape == (1, *small.decoder.sample_shape)
    # the round trip is decoded to pixels and measured against the image
    assert inv.reconstruction.shape == x.shape
    assert inv.error == pytest.approx(float((inv.reconstruction - x).pow(2).mean().sqrt()))
    out = small.text_diff(
        x, "a red circle", "a blue square", num_steps=3, steps=6, output_type="pt", progress=False
    )
    # θ = 0 decodes the inverted latents back to the inversion's reconstruction
    torch.testing.assert_close(out.images[0:1], (inv.reconstruction + 1) / 2, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.latents, inv.latents)
    assert (out.images[2] - out.images[0]).abs().max() > 1e-3


def train(out, vq, *overrides, args=()):
    return train_decoder.main(
        [
            str(CONFIGS / "tiny" / "decoder.yaml"),
            f"train.output_dir={out}",
            f"decoder.autoencoder={vq}",
            "train.progress=false",
            "train.warmup_steps=2",
            *overrides,
            *args,
        ]
    )


def test_train_decoder_trains_on_the_tokenizers_latents_and_resumes_exactly(tmp_path, vqgan_folder):
    common = ["train.max_steps=4", "train.checkpoint_every=2"]
    assert train(tmp_path / "full", vqgan_folder, *common) == 0
    assert train(tmp_path / "split", vqgan_folder, *common, args=["--max-steps-this-run", "2"]) == 0
    assert train(tmp_path / "split", vqgan_folder, *common, args=["--resume", "latest"]) == 0
    a = load_file(
        str(tmp_path / "full" / "final" / "decoder" / "diffusion_pytorch_model.safetensors")
    )
    b = load_file(
        str(tmp_path / "split" / "final" / "decoder" / "diffusion_pytorch_model.safetensors")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the autoencoder is the tokenizer's, untouched by training; the UNet moved
    tok = load_file(str(Path(vqgan_folder) / "model.safetensors"))
    for k, v in tok.items():
        assert torch.equal(a[f"latent_space.{k}"], v), k
    init = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert any(not torch.equal(init[k], a[k]) for k in init if k.startswith("unet."))
    d = UnCLIPDecoder.from_pretrained(tmp_path / "full" / "final" / "decoder")
    assert d.is_latent and d.latent_space.l2_codes and d.latent_space.scale == 2.0
    # its latents decode through the tokenizer's own decoder: snapped to codes, the same images
    # as the tokenizer draws from those codes
    from unclip.nets.token_components import load_tokenizer

    tokenizer, _ = load_tokenizer(vqgan_folder)
    x = torch.rand(2, 3, 16, 16, generator=gen()) * 2 - 1
    z = d.to_latents(x) + 0.01 * torch.randn(2, *d.sample_shape, generator=gen(1))
    torch.testing.assert_close(d.to_images(z).clamp(-1, 1), tokenizer.decode(tokenizer.encode(x)))


def test_autoencoder_folders_and_settings_are_checked(tmp_path, vqgan_folder):
    model, l2 = load_autoencoder(vqgan_folder)
    assert l2 and type(model).__name__ == "VQModel"
    kl = LatentSpace(tiny_latent_kwargs("AutoencoderKL")["autoencoder"])
    kl.model.save_pretrained(tmp_path / "kl")
    model, l2 = load_autoencoder(tmp_path / "kl")
    assert not l2 and type(model).__name__ == "AutoencoderKL"
    cfg = DecoderConfig(sample_size=16, autoencoder=str(tmp_path / "kl"), latent_scale=0.5)
    assert cfg.latent_scale == 0.5
    with pytest.raises(ValueError, match="latent_scale"):
        DecoderConfig(latent_scale=0.5)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_autoencoder(tmp_path)
    dvae = TokenizerConfig(
        type="dvae",
        dvae=DVAEConfig(image_size=32, num_codes=64, n_hid=8, blocks_per_group=1, n_init=16),
    )
    save_component(dvae.build(), tmp_path / "dvae", "tokenizer", dvae)
    with pytest.raises(ValueError, match="dvae tokenizer; a latent decoder needs continuous"):
        load_autoencoder(tmp_path / "dvae")
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ValueError, match="UNet2DModel"):
        load_autoencoder(tmp_path / "unet")
    with pytest.raises(ValueError, match="multiple"):
        tiny_pipeline(0, sizes=(18,), decoder_kwargs=tiny_latent_kwargs())
    with pytest.raises(ValueError, match="_class_name"):
        LatentSpace({"_class_name": "UNet2DModel"})


def test_unclip_plan_dry_runs_a_latent_decoder(tmp_path, vqgan_folder):
    """The plan builds the autoencoder from its folder's config (fake tensors cannot hold the
    file's weights) and runs the real training step: the frozen autoencoder is counted in the
    network's parameters and not among the trained ones."""
    from unclip.cli.plan import main as plan

    out = tmp_path / "plan.json"
    cfg = str(CONFIGS / "tiny" / "decoder.yaml")
    assert plan([cfg, f"decoder.autoencoder={vqgan_folder}", "--json", str(out)]) == 0
    m = json.loads(out.read_text())["measure"]
    frozen = sum(p.numel() for p in load_autoencoder(vqgan_folder)[0].parameters())
    assert m["params_total"] - m["params_trainable"] == frozen


def test_a_diffusers_autoencoder_folder_trains_exports_and_refuses_another(tmp_path):
    """A decoder over a diffusers AutoencoderKL folder trains and exports (its config nests the
    autoencoder's architecture only, no path); a resumed run over another autoencoder is refused
    before a step; decoder_loss refuses a latent decoder without its latent space."""
    from unclip.train.decoder import decoder_loss

    torch.manual_seed(0)
    kl = LatentSpace(tiny_latent_kwargs("AutoencoderKL")["autoencoder"])
    kl.model.save_pretrained(tmp_path / "kl")
    common = ["train.max_steps=2", "train.checkpoint_every=1"]
    assert train(tmp_path / "run", tmp_path / "kl", *common) == 0
    d = UnCLIPDecoder.from_pretrained(tmp_path / "run" / "final" / "decoder")
    assert d.latent_space.kind == "AutoencoderKL" and "_name_or_path" not in d.config.autoencoder
    other = LatentSpace(tiny_latent_kwargs("AutoencoderKL")["autoencoder"])
    other.model.save_pretrained(tmp_path / "kl2")
    more = ["train.max_steps=3", "train.checkpoint_every=1"]
    with pytest.raises(ValueError, match="differs from decoder.autoencoder="):
        train(tmp_path / "run", tmp_path / "kl2", *more, args=["--resume", "latest"])
    batch = {"image": torch.zeros(1, 3, 16, 16), "caption": ["x"]}
    with pytest.raises(ValueError, match="pass latent_space"):
        decoder_loss(d, batch, None, None, None, None, None, "cpu")
