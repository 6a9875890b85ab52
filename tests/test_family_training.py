"""The DALL-E and DALL-E Mega families end to end on tiny configs: ``unclip train-tokenizer`` and
``unclip train-tokens`` on the shared loop (exact resume, export), the token pipeline's folder
(save, load through the one loading entry, generate) and ``unclip generate --model`` on it."""

import json
from pathlib import Path

import pytest
import torch

from unclip.cli.train_tokenizer import main as train_tokenizer
from unclip.cli.train_tokens import main as train_tokens
from unclip.nets.token_components import load_token_model, load_tokenizer
from unclip.pipeline.auto import load_pipeline, pipeline_family
from unclip.pipeline.token_pipeline import TokenPipeline
from unclip.utils.images import pil_to_tensor

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny"

pytestmark = pytest.mark.usefixtures("one_thread", "reset_accelerate")


def _state(folder, loader):
    return loader(folder)[0].state_dict()


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny dVAE and VQGAN, trained once for the module: ``{kind: run folder}``."""
    root = tmp_path_factory.mktemp("tokenizers")
    runs = {}
    for kind in ("dvae", "vqgan"):
        out = root / kind
        assert train_tokenizer([str(TINY / f"{kind}.yaml"), "--output-dir", str(out)]) == 0
        runs[kind] = out
    return runs


@pytest.mark.parametrize("kind", ["dvae", "vqgan"])
def test_train_tokenizer_logs_round_trip_and_codebook_usage_and_resumes_exactly(
    tokenizers, kind, tmp_path
):
    full = tokenizers[kind]
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "roundtrip_mse" in r]
    assert len(logged) == 3  # log_every 2 of 6 steps
    assert all(0 < r["codebook_usage"] <= 1 and r["roundtrip_mse"] >= 0 for r in logged)
    if kind == "dvae":  # the schedule scaled to the run: τ falls to 1/16, β rises to 6.6
        assert logged[0]["temperature"] > logged[-1]["temperature"] == pytest.approx(1 / 16)
        assert logged[-1]["kl_weight"] == pytest.approx(6.6)
        codes = 64  # configs/tiny/dvae.yaml: the posterior's spread, in codes, is within 1..K
        assert all(1 <= r["token_perplexity"] <= r["posterior_perplexity"] <= codes for r in logged)
    split = ["--output-dir", str(tmp_path / "split")]
    assert train_tokenizer([str(TINY / f"{kind}.yaml"), *split, "--max-steps-this-run", "3"]) == 0
    assert not (tmp_path / "split" / "final").exists()
    assert train_tokenizer([str(TINY / f"{kind}.yaml"), *split, "--resume", "latest"]) == 0
    a = _state(full / "final" / "tokenizer", load_tokenizer)
    b = _state(tmp_path / "split" / "final" / "tokenizer", load_tokenizer)
    assert _equal(a, b)


@pytest.mark.parametrize("kind", ["dvae", "vqgan"])
def test_exported_tokenizer_round_trips_shapes_images(tokenizers, kind):
    """Images → tokens → images through the exported folder. Six steps teach little: the error
    is only required to be that of a working round trip (finite, below the error of a blank
    image) with the shapes and token range the config states."""
    from unclip.shapes.world import ShapesWorld

    tok, cfg = load_tokenizer(tokenizers[kind] / "final" / "tokenizer")
    world = ShapesWorld(32, seed=3, split="heldout")
    x = torch.stack([pil_to_tensor(world[i].image) for i in range(4)])
    tokens = tok.encode(x)
    assert tokens.shape == (4, 4, 4) and int(tokens.max()) < cfg.model.num_codes
    y = tok.decode(tokens)
    assert y.shape == x.shape and y.min() >= -1 and y.max() <= 1
    err = float(((y - x) ** 2).mean())
    assert err < float((x**2).mean() + 1)


@pytest.mark.parametrize(("family", "kind"), [("dalle", "dvae"), ("mega", "vqgan")])
def test_train_tokens_resumes_exactly_and_exports_a_pipeline(tokenizers, family, kind, tmp_path):
    tok = f"tokenizer={tokenizers[kind] / 'final' / 'tokenizer'}"
    cfg = str(TINY / f"{family}.yaml")
    full = tmp_path / "full"
    assert train_tokens([cfg, tok, "--output-dir", str(full)]) == 0
    split = ["--output-dir", str(tmp_path / "split")]
    assert train_tokens([cfg, tok, *split, "--max-steps-this-run", "3"]) == 0
    assert train_tokens([cfg, tok, *split, "--resume", "latest"]) == 0
    a = _state(full / "final" / "transformer", load_token_model)
    b = _state(tmp_path / "split" / "final" / "transformer", load_token_model)
    assert _equal(a, b)
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert any("image_loss" in r for r in records)
    assert any("text_loss" in r for r in records) == (family == "dalle")
    folder = full / "final" / "pipeline"
    index = json.loads((folder / "unclip.json").read_text())
    assert index["family"] == {"dalle": "dalle", "mega": "dalle_mega"}[family]
    assert pipeline_family(folder) == index["family"]


def test_token_pipeline_save_load_generate_and_the_generate_command(tokenizers, tmp_path):
    from unclip.cli.generate import main as generate

    tok = f"tokenizer={tokenizers['dvae'] / 'final' / 'tokenizer'}"
    assert train_tokens([str(TINY / "dalle.yaml"), tok, "--output-dir", str(tmp_path / "r")]) == 0
    pipe = load_pipeline(tmp_path / "r" / "final" / "pipeline")
    assert isinstance(pipe, TokenPipeline) and pipe.family == "dalle"
    prompts = ["a small red circle", "a blue square"]

    def sample(p):
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        return p(prompts, 2, generator=gens, output_type="pt")

    out = sample(pipe)
    assert out.images.shape == (4, 3, 32, 32) and set(out.timings) >= {"transformer", "tokenizer"}
    pipe.save_pretrained(tmp_path / "copy")
    again = load_pipeline(tmp_path / "copy")
    assert torch.equal(sample(again).images, out.images)  # same weights, same draws
    # a prompt's images do not depend on the prompts batched with it
    alone = again(prompts[1:], 2, generator=[torch.Generator().manual_seed(1)], output_type="pt")
    assert torch.equal(alone.images, out.images[2:])
    with pytest.raises(ValueError, match="no setting 'steps'"):
        pipe(prompts, sampling={"transformer": {"steps": 3}})
    # the unCLIP loader names the right entry instead of misreading the folder
    from unclip.pipeline.pipeline import UnCLIPPipeline

    with pytest.raises(ValueError, match="load_pipeline"):
        UnCLIPPipeline.from_pretrained(tmp_path / "copy")
    out_dir = tmp_path / "gen"
    assert generate([*prompts, "--model", str(tmp_path / "copy"), "--out", str(out_dir)]) == 0
    record = json.loads((out_dir / "generate.json").read_text())
    assert record["resolution"] == 32 and len(record["files"]) == 2
    assert "transformer" in record["sampling"]
