"""Training the autoregressive prior: the loss falls, the fit is made once and kept by resume,
exact resume through ``unclip train-prior``, export."""

import json

import pytest
import torch
from conftest import CONFIGS, gens
from safetensors.torch import load_file

from unclip import UnCLIPPipeline
from unclip.cli import train_prior
from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.clip import CLIP
from unclip.nets.decoder import UnCLIPDecoder
from unclip.pipeline.tiny import tiny_decoder_kwargs
from unclip.sampling.ar import sample_ar_prior
from unclip.sampling.settings import ARPriorSampling
from unclip.train.ar_prior import ar_prior_loss, fit_embeddings
from unclip.train.config import load_stage_config
from unclip.train.loop import sample_generators

CFG = CONFIGS / "tiny" / "prior_ar.yaml"
QUIET = ["train.progress=false"]


def train(out, *overrides, args=()):
    return train_prior.main([str(CFG), f"train.output_dir={out}", *QUIET, *overrides, *args])


def test_a_few_steps_lower_the_loss_on_a_tiny_fixed_set(tiny_clip):
    """Sixteen (caption, image embedding) pairs, the training loss with caption dropout: the codes
    of a fixed set are learnt quickly."""
    cfg = load_stage_config(CFG)
    torch.manual_seed(0)
    prior = cfg.prior.build(tiny_clip)
    captions = [
        f"{c} {s}"
        for c in ("red", "green", "blue", "white")
        for s in ("circle", "square", "star", "cross")
    ]
    image = torch.nn.functional.normalize(torch.randn(16, 32) * torch.linspace(2, 0.2, 32), dim=-1)
    text = tiny_clip.encode_text(captions)
    prior.fit_quantizer(
        image.repeat(10, 1) + 0.01 * torch.randn(160, 32), text.text_embed.repeat(10, 1)
    )
    batch = {"caption": captions, "image_embed": image}
    null = tiny_clip.encode_text([""])
    opt = torch.optim.AdamW(prior.parameters(), lr=5e-3)
    losses = []
    for step in range(20):
        loss = ar_prior_loss(
            prior, batch, tiny_clip, null, sample_generators(0, 0, 16 * step, 16), cfg, "cpu"
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[0] > 0.9 * torch.log(torch.tensor(64.0))  # chance: log K nats per code
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


def test_resume_is_exact_and_keeps_the_fit(tmp_path):
    """With DALL-E Mega's block options on (NormFormer + GEGLU), which the export keeps."""
    common = ["train.max_steps=6", "train.checkpoint_every=3", "train.warmup_steps=2"]
    common += ["prior.normformer=true", "prior.ff_activation=geglu"]
    assert train(tmp_path / "full", *common) == 0
    assert train(tmp_path / "split", *common, args=["--max-steps-this-run", "3"]) == 0
    assert not (tmp_path / "split" / "final").exists()
    # a resumed run keeps the checkpoint's PCA and buckets: fitting again on other samples would
    # change them (and so every code), and the weights would not match the uninterrupted run
    resumed = [*common, "prior.ar.fit_samples=100"]
    assert train(tmp_path / "split", *resumed, args=["--resume", "latest"]) == 0
    a = load_file(
        str(tmp_path / "full" / "final" / "prior" / "diffusion_pytorch_model.safetensors")
    )
    b = load_file(
        str(tmp_path / "split" / "final" / "prior" / "diffusion_pytorch_model.safetensors")
    )
    assert a.keys() == b.keys() and "bucket_edges" in a and "pca_components" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    init = load_file(str(tmp_path / "full" / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert any(not torch.equal(init[k], a[k]) for k in init if k.startswith("transformer."))
    assert bool(a["fitted"]) and torch.equal(init["bucket_edges"], a["bucket_edges"])
    # fitting on the other fit_samples gives other buckets (so the check above has teeth)
    clip = CLIP.from_pretrained(tmp_path / "full" / "final" / "clip")
    cfg = load_stage_config(CFG, ["prior.ar.fit_samples=100"])
    other = cfg.prior.build(clip)
    other.fit_quantizer(*fit_embeddings(cfg, clip, "cpu"))
    assert not torch.equal(other.bucket_edges, a["bucket_edges"])
    # the exported prior loads as an AR prior with the run's sampling settings and samples
    final = tmp_path / "full" / "final"
    meta = json.loads((final / "prior" / "unclip_stage.json").read_text())
    assert meta["stage"] == "prior" and meta["sampling"]["temperature"] == 1.0
    prior = UnCLIPARPrior.from_pretrained(final / "prior")
    assert prior.config.normformer and prior.config.ff_activation == "geglu"
    assert "transformer.blocks.0.head_scale" in a
    text = clip.encode_text(["a red circle"])
    s = ARPriorSampling(**{k: v for k, v in meta["sampling"].items()})
    best, cands = sample_ar_prior(
        prior, text, lambda n: clip.encode_text([""] * n), s, progress=False
    )
    assert best.shape == (1, 32) and cands.shape == (1, 2, 32) and torch.isfinite(best).all()
    # and a pipeline assembled from the exported folders carries it (the class is in config.json)
    UnCLIPDecoder.from_clip(clip, **tiny_decoder_kwargs(16)).save_pretrained(tmp_path / "decoder")
    with pytest.warns(UserWarning) as warned:  # the bare decoder has no settings or fingerprint
        pipe = UnCLIPPipeline.from_components(final / "clip", tmp_path / "decoder", final / "prior")
    assert any("unclip_stage.json" in str(w.message) for w in warned)
    assert isinstance(pipe.prior, UnCLIPARPrior) and pipe.sampling["prior"].temperature == 1.0
    emb = pipe.sample_image_embeds("a red circle", generator=gens(0), progress=False)
    assert emb.shape == (1, 32) and torch.isfinite(emb).all()
