import dataclasses
import inspect

import pytest
import torch
import yaml
from conftest import CONFIGS

from unclip.nets.ar_prior import UnCLIPARPrior
from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config
from unclip.nets.config import ARPriorOptions, DecoderConfig, PriorConfig, UpsamplerConfig
from unclip.nets.decoder import UnCLIPDecoder, UnCLIPUpsampler
from unclip.nets.prior import UnCLIPPrior
from unclip.train.config import StageConfig, TrainConfig, load_stage_config
from unclip.utils.config import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    save_config,
    to_dict,
    to_yaml,
)


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_misspelt_key_names_file_key_and_closest(tmp_path):
    p = write(tmp_path, {"stage": "prior", "prior": {}, "train": {"lrr": 1e-4}})
    with pytest.raises(ConfigError) as e:
        load_stage_config(p)
    msg = str(e.value)
    assert str(p) in msg and "train.lrr" in msg and "did you mean 'train.lr'" in msg


def test_misspelt_section(tmp_path):
    p = write(tmp_path, {"stage": "prior", "prior": {}, "trian": {}})
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_stage_config(p)


def test_wrong_types_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.max_steps.*integer"):
        load_stage_config(
            write(tmp_path, {"stage": "prior", "prior": {}, "train": {"max_steps": "many"}})
        )
    with pytest.raises(ConfigError, match="train.ema.*true or false"):
        load_stage_config(write(tmp_path, {"stage": "prior", "prior": {}, "train": {"ema": "yes"}}))
    with pytest.raises(ConfigError, match="diffusion.prediction_type.*one of"):
        load_stage_config(
            write(
                tmp_path, {"stage": "prior", "prior": {}, "diffusion": {"prediction_type": "eps"}}
            )
        )
    with pytest.raises(ConfigError, match="block_out_channels\\[1\\].*integer"):
        load_stage_config(
            write(tmp_path, {"stage": "decoder", "decoder": {"block_out_channels": [8, "x"]}})
        )


def test_ints_accepted_for_floats_and_kept_as_float():
    cfg = from_dict(TrainConfig, {"lr": 1})
    assert isinstance(cfg.lr, float) and cfg.lr == 1.0


def test_stage_needs_its_section(tmp_path):
    with pytest.raises(ConfigError, match="no 'decoder:' section"):
        load_stage_config(write(tmp_path, {"stage": "decoder", "prior": {}}))


def test_dotted_overrides(tmp_path):
    p = write(tmp_path, {"stage": "prior", "prior": {"num_layers": 2}})
    cfg = load_stage_config(
        p,
        [
            "train.lr=3e-4",
            "prior.num_layers=4",
            "data.source=folder",
            "train.ema=false",
            "train.adam_betas=[0.9, 0.99]",
        ],
    )
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.prior.num_layers == 4 and cfg.data.source == "folder" and cfg.train.ema is False
    assert cfg.train.adam_betas == [0.9, 0.99]
    with pytest.raises(ConfigError, match="train.lrate.*did you mean 'train.lr'"):
        load_stage_config(p, ["train.lrate=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_stage_config(p, ["train.lr"])


def test_yaml_boolean_words_are_words_on_the_command_line_and_a_clear_error_in_files(tmp_path):
    p = write(tmp_path, {"stage": "prior", "prior": {"num_layers": 2}})
    cfg = load_stage_config(p, ["train.mixed_precision=no", "train.ema=False"])
    assert cfg.train.mixed_precision == "no" and cfg.train.ema is False
    unquoted = tmp_path / "unquoted.yaml"
    unquoted.write_text("stage: prior\nprior: {num_layers: 2}\ntrain: {mixed_precision: no}\n")
    with pytest.raises(ConfigError, match="train.mixed_precision.*quote the word"):
        load_stage_config(unquoted)


def test_override_does_not_mutate_input():
    data = {"train": {"lr": 1.0}}
    out = apply_overrides(data, ["train.lr=2"])
    assert data["train"]["lr"] == 1.0 and out["train"]["lr"] == 2


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_stage_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_stage_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_stage_config(CONFIGS / "tiny" / "decoder.yaml", ["train.lr=5e-4"])
    save_config(cfg, tmp_path / "saved.yaml")
    again = load_stage_config(tmp_path / "saved.yaml")
    assert to_dict(again) == to_dict(cfg)
    assert "lr: 0.0005" in to_yaml(cfg)


STAGE_CONFIGS = sorted(p for p in CONFIGS.glob("**/*.yaml") if "\nstage:" in "\n" + p.read_text())


@pytest.mark.parametrize("path", STAGE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert len(STAGE_CONFIGS) >= 8
    cfg = load_stage_config(path)
    assert isinstance(cfg, StageConfig) and cfg.model is not None


# ------------------------------------------------------------------------------------------------
# the architecture configs build what they describe
# ------------------------------------------------------------------------------------------------
ARCHITECTURES = [
    (PriorConfig, UnCLIPPrior),
    (PriorConfig, UnCLIPARPrior),
    (ARPriorOptions, UnCLIPARPrior),
    (DecoderConfig, UnCLIPDecoder),
    (UpsamplerConfig, UnCLIPUpsampler),
]
#: fields that choose the model or feed its training, not arguments of the model
NOT_ARGUMENTS = {"type", "ar", "fit_samples", "embed_scale"}  # embed_scale: stored as statistics
#: options of the diffusion prior's transformer blocks that the AR prior refuses (test below),
#: and its own caption transformer's (PriorConfig refuses text_encoder: transformer for type ar)
DIFFUSION_PRIOR_ONLY = {"normformer", "ff_activation"} | {
    f.name for f in dataclasses.fields(PriorConfig) if f.name.startswith("text_")
}


@pytest.mark.parametrize("config_cls, model_cls", ARCHITECTURES, ids=lambda c: c.__name__)
def test_every_architecture_field_is_a_model_argument_with_the_same_default(config_cls, model_cls):
    params = inspect.signature(model_cls.__init__).parameters
    config = config_cls()
    for f in dataclasses.fields(config_cls):
        if f.name in NOT_ARGUMENTS:
            continue
        if model_cls is UnCLIPARPrior and f.name in DIFFUSION_PRIOR_ONLY:
            continue
        assert f.name in params, (
            f"{config_cls.__name__}.{f.name} is no {model_cls.__name__} argument"
        )
        default = params[f.name].default
        value = getattr(config, f.name)
        if isinstance(default, tuple):
            default = list(default)
        assert value == default, (f.name, value, default)


@pytest.mark.parametrize("option", [{"normformer": True}, {"ff_activation": "swiglu"}])
def test_both_priors_build_with_the_block_options(option):
    """prior.normformer / prior.ff_activation reach the blocks of either prior type."""
    clip = _tiny_clip()
    size = dict(num_layers=1, num_attention_heads=2, attention_head_dim=8)
    for kind in ("diffusion", "ar"):
        prior = PriorConfig(type=kind, **size, **option).build(clip)
        for key, value in option.items():
            assert prior.config[key] == value, (kind, key)
        names = " ".join(n for n, _ in prior.named_parameters())
        assert ("head_scale" in names) == bool(option.get("normformer")), kind


def _tiny_clip():
    torch.manual_seed(0)
    return CLIP.from_config(ClipConfig("tiny", None, tiny_clip_config()))


def test_configs_build_their_models_with_every_setting():
    clip = _tiny_clip()
    prior_cfg = PriorConfig(num_layers=1, num_attention_heads=2, attention_head_dim=8, dropout=0.1)
    prior = prior_cfg.build(clip)
    assert isinstance(prior, UnCLIPPrior)
    assert prior.config.embed_dim == clip.embed_dim and prior.config.text_width == clip.text_width
    decoder_cfg = load_config(
        {
            "sample_size": 16,
            "block_out_channels": [16, 32],
            "layers_per_block": 1,
            "down_block_types": ["ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"],
            "up_block_types": ["SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"],
            "attention_head_dim": 8,
            "norm_num_groups": 8,
            "coord_channels": True,
            "embed_scale": 2.0,
        },
        schema=DecoderConfig,
    )
    decoder = decoder_cfg.build(clip)
    assert isinstance(decoder, UnCLIPDecoder) and decoder.config.embed_dim == clip.embed_dim
    up_cfg = UpsamplerConfig(
        sample_size=32,
        low_res_size=16,
        block_out_channels=[8, 16],
        layers_per_block=1,
        down_block_types=["DownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "UpBlock2D"],
        norm_num_groups=8,
        noise_level=7,
    )
    upsampler = up_cfg.build()
    assert isinstance(upsampler, UnCLIPUpsampler)
    ar_cfg = PriorConfig(
        type="ar",
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=8,
        dropout=0.1,
        ar=ARPriorOptions(pca_dims=5, num_buckets=7, dot_buckets=3),
    )
    ar = ar_cfg.build(clip)
    assert isinstance(ar, UnCLIPARPrior)
    pairs = [(prior_cfg, prior), (decoder_cfg, decoder), (up_cfg, upsampler), (ar_cfg, ar)]
    pairs.append((ar_cfg.ar, ar))
    for cfg, model in pairs:
        for key, value in to_dict(cfg).items():
            if key in NOT_ARGUMENTS:
                continue
            if isinstance(model, UnCLIPARPrior) and key in DIFFUSION_PRIOR_ONLY:
                continue
            built = model.config[key]
            assert (list(built) if isinstance(built, tuple) else built) == value, key


def test_core_loader_needs_an_explicit_schema(tmp_path):
    p = write(tmp_path, {"sample_size": 32, "layers_per_block": 2})
    assert load_config(p, schema=DecoderConfig).layers_per_block == 2
    with pytest.raises(TypeError, match="schema"):
        load_config(p)
    with pytest.raises(ConfigError, match="unknown key 'out_channels'"):
        load_config({"out_channels": 6}, schema=DecoderConfig)


def test_upsampler_training_settings_live_in_their_own_section(tmp_path):
    cfg = load_stage_config(CONFIGS / "tiny" / "sr32.yaml")
    assert cfg.upsampler_train.corruption == "blur" and cfg.upsampler_train.max_noise_level == 250
    with pytest.raises(ConfigError, match="unknown key 'upsampler.corruption'"):
        load_stage_config(CONFIGS / "tiny" / "sr32.yaml", ["upsampler.corruption=bsr"])
    bare = write(tmp_path, {"stage": "upsampler", "upsampler": {}})
    assert load_stage_config(bare).upsampler_train.corruption == "blur"  # the defaults
    wrong = write(tmp_path, {"stage": "decoder", "decoder": {}, "upsampler_train": {}}, "w.yaml")
    with pytest.raises(ConfigError, match="'upsampler_train:' applies to stage 'upsampler' only"):
        load_stage_config(wrong)


def test_a_command_refuses_a_config_of_another_stage():
    with pytest.raises(ValueError, match="this command trains decoder or upsampler"):
        load_stage_config(CONFIGS / "tiny" / "prior.yaml", stages=("decoder", "upsampler"))
