"""What a config or a pipeline folder from elsewhere may do: a ``pipe:`` data URL runs a shell
command only when the config says so, and a pipeline folder's components are read from inside
it unless the caller allows otherwise."""

import json
import shutil

import pytest
from conftest import CONFIGS

from unclip.cli.errors import run_main

SR32 = CONFIGS / "tiny" / "sr32.yaml"


def test_a_pipe_data_url_runs_nothing_without_data_allow_pipe(tmp_path, capsys):
    from unclip.cli.train_decoder import main as train_decoder
    from unclip.train.config import load_stage_config

    mark = tmp_path / "ran"
    pipe = f"pipe:touch {mark}"
    argv = [str(SR32), "data.source=webdataset", f"data.path={pipe}", "train.progress=false"]
    status = run_main("unclip train-decoder", train_decoder, [*argv, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1 and len(err.splitlines()) == 1, err
    assert "runs a shell command" in err and "data.allow_pipe=true" in err, err
    assert not mark.exists()
    cfg = load_stage_config(SR32, argv[1:3] + ["data.allow_pipe=true"])  # asked for: accepted
    assert cfg.data.path == pipe and cfg.data.allow_pipe
    with pytest.raises(ValueError, match="data.allow_pipe"):  # one of a '::' list
        load_stage_config(SR32, ["data.source=webdataset", f"data.path=a.tar::{pipe}"])


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from unclip.pipeline.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("trust") / "pipe"
    tiny_pipeline(seed=0, sizes=(16,)).save_pretrained(path)
    return path


@pytest.mark.parametrize("outside", ["../other/decoder", "ABSOLUTE", "LINK"])
def test_a_component_outside_the_pipeline_folder_is_refused_unless_allowed(
    pipe_dir, tmp_path, outside
):
    from unclip.pipeline.pipeline import UnCLIPPipeline

    pipe = tmp_path / "pipe"
    shutil.copytree(pipe_dir, pipe)
    other = tmp_path / "other" / "decoder"
    other.parent.mkdir()
    (pipe / "decoder").rename(other)
    if outside == "ABSOLUTE":
        outside = str(other)
    elif outside == "LINK":  # a link inside the folder that leads out of it
        (pipe / "decoder").symlink_to(other, target_is_directory=True)
        outside = "decoder"
    index = json.loads((pipe / "unclip.json").read_text())
    index["components"]["decoder"] = outside
    (pipe / "unclip.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the pipeline folder.*allow_external_components"):
        UnCLIPPipeline.from_pretrained(pipe)
    loaded = UnCLIPPipeline.from_pretrained(pipe, allow_external_components=True)
    assert loaded.decoder.config.sample_size == 16


def test_a_token_pipeline_component_outside_its_folder_is_refused(tmp_path):
    from unclip.pipeline.auto import load_pipeline

    pipe = tmp_path / "pipe"
    pipe.mkdir()
    index = {"family": "dalle", "components": {"tokenizer": "../tok", "transformer": "tr"}}
    (pipe / "unclip.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'../tok', which is outside the pipeline folder"):
        load_pipeline(pipe)
