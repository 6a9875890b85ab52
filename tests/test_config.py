import pytest
import yaml
from conftest import CONFIGS

from unclip.config import (
    ConfigError,
    StageConfig,
    TrainConfig,
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
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "train.lrr" in msg and "did you mean 'train.lr'" in msg


def test_misspelt_section(tmp_path):
    p = write(tmp_path, {"stage": "prior", "prior": {}, "trian": {}})
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(p)


def test_wrong_types_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.max_steps.*integer"):
        load_config(
            write(tmp_path, {"stage": "prior", "prior": {}, "train": {"max_steps": "many"}})
        )
    with pytest.raises(ConfigError, match="train.ema.*true or false"):
        load_config(write(tmp_path, {"stage": "prior", "prior": {}, "train": {"ema": "yes"}}))
    with pytest.raises(ConfigError, match="diffusion.prediction_type.*one of"):
        load_config(
            write(
                tmp_path, {"stage": "prior", "prior": {}, "diffusion": {"prediction_type": "eps"}}
            )
        )
    with pytest.raises(ConfigError, match="block_out_channels\\[1\\].*integer"):
        load_config(
            write(tmp_path, {"stage": "decoder", "decoder": {"block_out_channels": [8, "x"]}})
        )


def test_ints_accepted_for_floats_and_kept_as_float():
    cfg = from_dict(TrainConfig, {"lr": 1})
    assert isinstance(cfg.lr, float) and cfg.lr == 1.0


def test_stage_needs_its_section(tmp_path):
    with pytest.raises(ConfigError, match="no 'decoder:' section"):
        load_config(write(tmp_path, {"stage": "decoder", "prior": {}}))


def test_dotted_overrides(tmp_path):
    p = write(tmp_path, {"stage": "prior", "prior": {"num_layers": 2}})
    cfg = load_config(
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
        load_config(p, ["train.lrate=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(p, ["train.lr"])


def test_override_does_not_mutate_input():
    data = {"train": {"lr": 1.0}}
    out = apply_overrides(data, ["train.lr=2"])
    assert data["train"]["lr"] == 1.0 and out["train"]["lr"] == 2


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "tiny" / "decoder.yaml", ["train.lr=5e-4"])
    save_config(cfg, tmp_path / "saved.yaml")
    again = load_config(tmp_path / "saved.yaml")
    assert to_dict(again) == to_dict(cfg)
    assert "lr: 0.0005" in to_yaml(cfg)


STAGE_CONFIGS = sorted(p for p in CONFIGS.glob("**/*.yaml") if "\nstage:" in "\n" + p.read_text())


@pytest.mark.parametrize("path", STAGE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert len(STAGE_CONFIGS) >= 8
    cfg = load_config(path)
    assert isinstance(cfg, StageConfig) and cfg.model is not None
