"""Faults of the token families (DALL-E, DALL-E Mega) and their tokenizers, guarded as unCLIP's
stages are: non-finite or degenerate sampling settings refused where the settings type is made
(config, ``unclip.json``, API override), non-finite logits and decoded pixels stopped with one
line naming the stage."""

import json
import math
import shutil

import pytest
import torch
from conftest import CONFIGS, token_pipeline

from unclip.cli.errors import run_main
from unclip.cli.train_tokens import main as train_tokens
from unclip.nets.token_components import load_token_model, load_tokenizer
from unclip.pipeline.auto import load_pipeline
from unclip.sampling.tokens import (
    MAX_CANDIDATES,
    MIN_TEMPERATURE,
    TokenSampling,
    sample_image_tokens,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_line(capsys, status, prog, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1, err
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    for needle in needles:
        assert needle in err[0], err
    return err[0]


# --------------------------------------------------------------------------------------------------
# sampling settings: refused at the door
# --------------------------------------------------------------------------------------------------
#: (setting, value, what the one-line message says)
BAD_SETTINGS = [
    ("temperature", float("nan"), "sampling.temperature must be a finite number >= 1e-06"),
    ("temperature", float("inf"), "sampling.temperature must be a finite number"),
    ("temperature", 1e-300, "for greedy sampling use top_k=1"),
    ("temperature", True, "sampling.temperature must be"),
    ("top_p", float("nan"), "sampling.top_p must be in (0, 1]"),
    ("top_k", True, "sampling.top_k must be an integer >= 1"),
    ("guidance_scale", float("nan"), "sampling.guidance_scale (super-conditioning's alpha)"),
    ("guidance_scale", float("inf"), "must be a finite number or null"),
    ("guidance_scale", -float("inf"), "must be a finite number or null"),
    ("guidance_scale", "3", "must be a finite number or null"),
    ("candidates", 0, f"sampling.candidates must be an integer in 1 … {MAX_CANDIDATES}"),
    ("candidates", 100000, f"sampling.candidates must be an integer in 1 … {MAX_CANDIDATES}"),
    ("use_cache", "no", "sampling.use_cache must be true or false"),
]
IDS = [f"{k}={v!r}" for k, v, _ in BAD_SETTINGS]


@pytest.mark.parametrize(("key", "value", "message"), BAD_SETTINGS, ids=IDS)
def test_token_settings_refuse_non_finite_and_degenerate_values(key, value, message):
    with pytest.raises(ValueError) as err:
        TokenSampling(**{key: value})
    assert message in str(err.value) and "\n" not in str(err.value)
    if key in ("temperature", "top_k", "top_p", "guidance_scale"):  # the sampler's arguments
        with pytest.raises(ValueError, match=f"sample_image_tokens.{key} "):
            sample_image_tokens(None, torch.zeros(1, 4, dtype=torch.long), **{key: value})


@pytest.mark.parametrize("key", ["temperature", "guidance_scale"])
def test_a_non_finite_setting_in_a_pipeline_folder_or_an_override_is_one_line(
    token_parts, tmp_path, key
):
    """unclip.json written with NaN (Python's json writes and reads it) and the same value as an
    API override (the web form's and evaluate --sampling's route): refused before sampling."""
    pipe = token_pipeline(token_parts, upsamplers=False)
    with pytest.raises(ValueError, match=f"sampling.{key} "):
        pipe("a red square", sampling={"transformer": {key: float("nan")}})
    folder = pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((folder / "unclip.json").read_text())
    index["sampling"]["transformer"][key] = float("nan")
    (folder / "unclip.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"sampling.{key} ") as err:
        load_pipeline(folder)
    assert "\n" not in str(err.value)


def test_train_tokens_refuses_a_nan_guidance_scale_before_it_starts(tmp_path, capsys):
    """`train-tokens sampling.guidance_scale=.nan` once trained and exported a pipeline with it."""
    out = tmp_path / "run"
    argv = [str(CONFIGS / "tiny" / "dalle.yaml"), "sampling.guidance_scale=.nan"]
    status = run_main("unclip train-tokens", train_tokens, [*argv, "--output-dir", str(out)])
    _one_line(capsys, status, "unclip train-tokens", "guidance_scale", "finite")
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# non-finite values while sampling: one line naming the stage
# --------------------------------------------------------------------------------------------------
def _ids(pipe, n=2):
    return pipe.transformer_config.caption_ids(["a red square"] * n)


def test_nan_transformer_weights_stop_with_the_stage_named(token_parts, tmp_path):
    root, _ = token_parts
    net, _ = load_token_model(root / "transformer")
    with torch.no_grad():  # a diverged checkpoint: NaN everywhere
        for p in net.parameters():
            p.fill_(float("nan"))
    pipe = token_pipeline(token_parts, upsamplers=False)
    ids, mask = _ids(pipe)
    for scale in (None, 3.0):
        with pytest.raises(ValueError) as err:
            sample_image_tokens(net, ids, mask, guidance_scale=scale)
        msg = str(err.value)
        assert msg.startswith("the token transformer produced NaN/inf logits at image token 0")
        assert "its weights hold NaN/inf" in msg and "\n" not in msg


def test_logits_overflowed_by_the_settings_stop_and_blame_the_settings(token_parts):
    """Finite weights, an α that overflows float32: no silent token 0, the settings are named."""
    pipe = token_pipeline(token_parts, upsamplers=False)
    ids, mask = _ids(pipe)
    with pytest.raises(ValueError) as err:
        sample_image_tokens(
            pipe.transformer, ids, mask, guidance_scale=3e38, temperature=MIN_TEMPERATURE
        )
    msg = str(err.value)
    assert "produced NaN/inf logits at image token 0" in msg
    assert "weights are finite" in msg and "guidance_scale" in msg


@pytest.mark.parametrize("kind", ["dvae", "vqgan"])
def test_a_nan_tokenizer_decoder_stops_with_one_line(token_parts, tmp_path, kind):
    """A NaN decoder once wrote black images with only numpy's cast warning."""
    if kind == "dvae":
        tok, cfg = load_tokenizer(token_parts[0] / "tokenizer")
        grid = cfg.model.grid
    else:
        from unclip.nets.vqgan import VQGANConfig

        vq = VQGANConfig(**_TINY_VQGAN)
        tok, grid = vq.build().eval(), vq.grid
    tokens = torch.zeros(2, grid, grid, dtype=torch.long)
    assert torch.isfinite(tok.decode(tokens)).all()
    with torch.no_grad():
        for p in tok.parameters():
            p.fill_(float("nan"))
    with pytest.raises(ValueError) as err:
        tok.decode(tokens)
    assert str(err.value) == (
        f"the tokenizer decoder ({kind}) produced NaN/inf pixels: its weights hold NaN/inf; "
        "check the tokenizer folder (or retrain it)"
    )
    assert not torch.isfinite(tok.decode(tokens, check=False)).all()  # training's metrics


_TINY_VQGAN = dict(
    image_size=16,
    block_out_channels=(8, 8),
    layers_per_block=1,
    latent_channels=4,
    num_codes=16,
    norm_num_groups=4,
)


def test_a_pipeline_with_a_nan_tokenizer_raises_instead_of_black_images(token_parts, tmp_path):
    root, ups = token_parts
    work = tmp_path / "parts"
    shutil.copytree(root / "tokenizer", work / "tokenizer")
    from safetensors.torch import load_file, save_file

    weights = work / "tokenizer" / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: torch.full_like(v, math.nan) for k, v in state.items()}, str(weights))
    from unclip.pipeline.token_pipeline import TokenPipeline

    pipe = TokenPipeline.from_components(work / "tokenizer", root / "transformer")
    with pytest.raises(ValueError, match=r"^the tokenizer decoder \(dvae\) produced NaN/inf"):
        pipe("a red square", output_type="pt")


# --------------------------------------------------------------------------------------------------
# resume over another tokenizer
# --------------------------------------------------------------------------------------------------
def test_a_resume_over_another_tokenizer_is_refused(token_parts, tmp_path, capsys):
    """The frozen tokenizer replaced between a checkpoint and `--resume latest` once trained on on
    the other tokenizer's codes without a word: the run records the tokenizer's fingerprint in its
    checkpoints and a resume over another one is one line naming both; the same tokenizer
    resumes."""
    from safetensors.torch import load_file, save_file

    root, _ = token_parts
    out = tmp_path / "run"
    argv = [
        str(CONFIGS / "tiny" / "dalle.yaml"),
        "data.resolution=16",
        "transformer.dalle.image_vocab_size=16",
        "transformer.dalle.text_len=8",
        "train.max_steps=2",
        "train.checkpoint_every=1",
        "--output-dir",
        str(out),
    ]
    status = run_main(
        "unclip train-tokens",
        train_tokens,
        [*argv, f"tokenizer={root / 'tokenizer'}", "--max-steps-this-run", "1"],
    )
    assert status == 0, capsys.readouterr().err
    capsys.readouterr()
    other = tmp_path / "other_tokenizer"  # the same architecture, other weights
    shutil.copytree(root / "tokenizer", other)
    state = load_file(str(other / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in state.items()}, str(other / "model.safetensors"))
    status = run_main(
        "unclip train-tokens", train_tokens, [*argv, f"tokenizer={other}", "--resume", "latest"]
    )
    _one_line(
        capsys,
        status,
        "unclip train-tokens",
        "step_00000001 was trained over the tokenizer",
        str(root / "tokenizer"),
        str(other),
        "resume with the tokenizer the run started with",
    )
    assert not (out / "final").exists()
    status = run_main(
        "unclip train-tokens",
        train_tokens,
        [*argv, f"tokenizer={root / 'tokenizer'}", "--resume", "latest"],
    )
    assert status == 0, capsys.readouterr().err
    assert (out / "final" / "transformer").is_dir()


# --------------------------------------------------------------------------------------------------
# sizes: degenerate and absurd configs are config errors with the bound stated
# --------------------------------------------------------------------------------------------------
#: (command, config, override, what the one-line message says)
BAD_SIZES = [
    ("tokenizer", "dvae", "tokenizer.dvae.num_codes=0", "dvae.num_codes must be an integer in 2"),
    ("tokenizer", "dvae", "tokenizer.dvae.num_codes=1000000000", "2 … 262,144, got 1000000000"),
    ("tokenizer", "dvae", "tokenizer.dvae.n_hid=0", "dvae.n_hid must be an integer in 1 … 8,192"),
    ("tokenizer", "dvae", "tokenizer.dvae.groups=0", "dvae.groups must be an integer in 1 … 8"),
    ("tokenizer", "vqgan", "tokenizer.vqgan.num_codes=0", "vqgan.num_codes must be an integer"),
    ("tokenizer", "vqgan", "tokenizer.vqgan.block_out_channels=[]", "a list of 1 … 8 widths"),
    ("tokenizer", "vqgan", "tokenizer.vqgan.block_out_channels=[8,0]", "block_out_channels[1]"),
    ("tokenizer", "vqgan", "tokenizer.vqgan.commitment_weight=.nan", "a finite number >= 0"),
    ("tokens", "dalle", "transformer.dalle.grid=0", "dalle.grid must be an integer in 1 … 128"),
    ("tokens", "dalle", "transformer.dalle.num_layers=0", "dalle.num_layers must be an integer"),
    ("tokens", "dalle", "transformer.dalle.image_vocab_size=1000000000", "dalle.image_vocab_size"),
    ("tokens", "mega", "transformer.mega.width=0", "mega.width must be an integer in 1 … 65,536"),
    ("tokens", "mega", "transformer.mega.dropout=1.5", "mega.dropout must be in [0, 1)"),
]


@pytest.mark.parametrize(("command", "config", "override", "message"), BAD_SIZES)
def test_degenerate_or_absurd_token_sizes_are_config_errors(
    command, config, override, message, tmp_path, capsys
):
    """`num_codes: 0` once failed in a zero-size convolution deep inside, `1e9` tried to allocate
    256 GB: every size of the token families' configs has a stated bound, checked when the
    config loads (before any tokenizer folder is read or network built)."""
    from unclip.cli.train_tokenizer import main as train_tokenizer

    main = train_tokenizer if command == "tokenizer" else train_tokens
    out = tmp_path / "run"
    argv = [str(CONFIGS / "tiny" / f"{config}.yaml"), override, "--output-dir", str(out)]
    status = run_main(f"unclip train-{command}", main, argv)
    _one_line(capsys, status, f"unclip train-{command}", message)
    assert not out.exists()


def test_a_tokenizer_folder_with_a_degenerate_size_names_the_file(token_parts, tmp_path):
    root, _ = token_parts
    folder = tmp_path / "tokenizer"
    shutil.copytree(root / "tokenizer", folder)
    meta = json.loads((folder / "config.json").read_text())
    meta["config"]["dvae"]["num_codes"] = 0
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as err:
        load_tokenizer(folder)
    msg = str(err.value)
    assert str(folder / "config.json") in msg and "dvae.num_codes must be an integer in 2" in msg
    assert "\n" not in msg


# --------------------------------------------------------------------------------------------------
# the VQGAN's perceptual weights
# --------------------------------------------------------------------------------------------------
def _perceptual_file(tmp_path, name: str, kind: str):
    from safetensors.torch import save_file

    from unclip.nets.vqgan import PerceptualLoss

    state = {f"features.{k}": v for k, v in PerceptualLoss().features.state_dict().items()}
    path = tmp_path / name
    if kind == "pickle":
        torch.save(state, path)
    elif kind == "corrupt":  # a pickle under the safetensors name: its "header" is nonsense
        torch.save(state, path)
    elif kind == "truncated":
        save_file(state, str(path))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # another network's weights: one tensor of another shape
        state["features.0.weight"] = torch.zeros(8, 3, 3, 3)
        save_file(state, str(path))
    return path


@pytest.mark.parametrize(
    ("name", "kind", "message"),
    [
        ("vgg.pth", "pickle", "is a pickle, which can run code when loaded"),
        ("vgg.safetensors", "corrupt", "is truncated or corrupt"),
        ("vgg.safetensors", "truncated", "is truncated or corrupt"),
        ("vgg.safetensors", "shape", "'features.0.weight' has shape (8, 3, 3, 3), VGG16"),
    ],
)
def test_perceptual_weights_that_are_a_pickle_or_corrupt_are_one_line(
    tmp_path, capsys, name, kind, message
):
    """VQGAN perceptual weights that were a pickle (refused by torch's weights-only unpickler,
    nothing ran) or a corrupt file once showed a raw UnpicklingError / SafetensorError
    traceback: each is one line naming the file, a pickle refused before it is opened and the
    files checked when the config loads, before the run claims its folder."""
    from unclip.cli.train_tokenizer import main as train_tokenizer
    from unclip.nets.vqgan import PerceptualLoss

    path = _perceptual_file(tmp_path, name, kind)
    out = tmp_path / "run"
    argv = [str(CONFIGS / "tiny" / "vqgan.yaml"), f"tokenizer.vqgan.perceptual_weights={path}"]
    status = run_main("unclip train-tokenizer", train_tokenizer, [*argv, "--output-dir", str(out)])
    _one_line(capsys, status, "unclip train-tokenizer", str(path), message)
    assert not out.exists()
    with pytest.raises(ValueError) as err:  # the Python API's loader says the same
        PerceptualLoss.from_file(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)
