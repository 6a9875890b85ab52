"""Faults in data, weight files, component folders and ``unclip embed`` inputs: each gives one
line naming the file and what to do (or is skipped and counted), and leaves nothing half-done."""

import json
import logging
import tarfile
from pathlib import Path

import pytest
import torch

from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config
from unclip.shapes.export import write_shapes
from unclip.train import embed
from unclip.train.data.sources import WebDatasetStream

# Accelerate keeps process-wide state that a later test must not inherit
pytestmark = pytest.mark.usefixtures("reset_accelerate")


# ---------------------------------------------------------------------- truncated webdataset shard
def truncated_shard(root: Path, n: int = 8, cut_sample: int = 5) -> tuple[Path, list[str]]:
    """A real img2dataset-style shard of ``n`` samples cut 100 bytes into the tar header of sample
    ``cut_sample``'s first member; returns the shard and the keys fully before the cut."""
    write_shapes(root, n, resolution=16, format="webdataset", shard_size=n, progress=False)
    (shard,) = sorted(root.glob("*.tar"))
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    keys = sorted({m.name.split(".")[0] for m in members})
    first = next(m for m in members if m.name.startswith(keys[cut_sample] + "."))
    data = shard.read_bytes()
    shard.write_bytes(data[: first.offset + 100])
    stats = shard.with_name(shard.stem + "_stats.json")
    assert json.loads(stats.read_text())["successes"] == n  # as img2dataset writes it
    stats.unlink()  # tests that need it write it back
    return shard, keys[:cut_sample]


def first_epoch(stream, count):
    it = iter(stream)
    return [next(it) for _ in range(count)]


def test_shard_truncated_inside_a_tar_header_is_counted_and_logged(tmp_path, caplog):
    shard, before = truncated_shard(tmp_path / "wds")
    stream = WebDatasetStream(
        str(shard), 16, shuffle_buffer=0, seed=0, rank=0, world_size=1, worker=0, num_workers=1
    )
    with caplog.at_level(logging.WARNING, logger="unclip.train.data.sources"):
        samples = first_epoch(stream, len(before) + 1)  # the next epoch's first sample
    assert [s["caption"] for s in samples[:-1]] and all(s["skipped"] == 0 for s in samples[:-1])
    # the broken shard is one skipped event (its size is unknown), counted before epoch 2 begins
    assert samples[-1]["skipped"] == 1
    assert f"broken shard {shard}" in caplog.text and "cut short" in caplog.text
    assert "re-download or re-create the shard" in caplog.text

    # with img2dataset's <shard>_stats.json beside it, the lost samples are known and counted
    shard.with_name(shard.stem + "_stats.json").write_text(json.dumps({"successes": 8}))
    samples = first_epoch(stream, len(before) + 1)
    assert samples[-1]["skipped"] == 8 - len(before)
    assert f"{8 - len(before)} sample(s) lost" in caplog.text


def test_embed_reports_a_truncated_shard_as_skipped(tmp_path, clip_dir, capsys):
    shard, before = truncated_shard(tmp_path / "wds")
    job = embed.EmbedJob(
        "webdataset", str(clip_dir), str(tmp_path / "out"), data=str(shard), progress=False
    )
    assert embed.embed(job) == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["count"] == len(before) and stats["skipped"] == 1
    assert "(skipped 1 bad samples)" in capsys.readouterr().out


# ------------------------------------------------------------------------- pickled weight files
class _Payload:
    """Unpickling this creates ``marker``: the proof that a loader ran code from a weights file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious(file: Path, marker: Path) -> Path:
    """A weights pickle whose payload creates ``marker`` when unpickled."""
    torch.save({"weight": torch.zeros(1), "payload": _Payload(marker)}, file)
    return file


def test_the_malicious_pickle_is_live(tmp_path):
    # guards the tests below: loading this file the unsafe way does run the payload
    torch.load(malicious(tmp_path / "x.bin", tmp_path / "proof"), weights_only=False)
    assert (tmp_path / "proof").exists()


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from unclip.pipeline.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("pipe")
    tiny_pipeline(seed=0, sizes=(16, 32)).save_pretrained(path)
    return path


@pytest.fixture
def pipe_copy(pipe_dir, tmp_path):
    import shutil

    return Path(shutil.copytree(pipe_dir, tmp_path / "pipe"))


@pytest.mark.parametrize(
    "component, cls_name",
    [("prior", "UnCLIPPrior"), ("decoder", "UnCLIPDecoder"), ("sr32", "UnCLIPUpsampler")],
)
def test_component_folders_refuse_pickles_without_running_them(pipe_copy, component, cls_name):
    import unclip
    from unclip.pipeline.pipeline import UnCLIPPipeline

    folder = pipe_copy / component
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    bad = malicious(folder / "diffusion_pytorch_model.bin", pipe_copy / "marker")
    convert = rf"no safetensors weights in {folder}; {bad} is a pickle.*torch.load\('{bad}'"
    with pytest.raises(ValueError, match=convert):
        getattr(unclip, cls_name).from_pretrained(folder)
    with pytest.raises(ValueError, match=convert):
        getattr(unclip, cls_name).from_pretrained(folder, use_safetensors=None)
    with pytest.raises(ValueError, match=convert):
        UnCLIPPipeline.from_pretrained(pipe_copy)
    p = pipe_copy
    with pytest.raises(ValueError, match=convert):
        UnCLIPPipeline.from_components(p / "clip", p / "decoder", p / "prior", [p / "sr32"])
    assert not (pipe_copy / "marker").exists()


@pytest.mark.parametrize("name", ["model.bin", "open_clip_pytorch_model.bin", "clip.pt", "c.ckpt"])
def test_clip_weights_refuse_pickles_without_running_them(pipe_copy, tmp_path, name):
    from unclip.nets.clip_weights import load_pretrained_weights

    folder = pipe_copy / "clip"
    (folder / "model.safetensors").unlink()
    bad = malicious(folder / name, tmp_path / "marker")
    clip = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config()))
    with pytest.raises(ValueError, match=rf"clip: {bad} is a pickle.*save_file"):
        load_pretrained_weights(clip.model, "tiny", str(bad))  # clip.pretrained=<file>
    with pytest.raises(ValueError, match=rf"clip: no safetensors weights in {folder}; {bad}"):
        CLIP.from_pretrained(folder)
    if name == "open_clip_pytorch_model.bin":  # clip.pretrained=<folder> of an open_clip model
        with pytest.raises(ValueError, match=rf"clip: no safetensors weights in {folder}; {bad}"):
            load_pretrained_weights(clip.model, "tiny", str(folder))
    assert not (tmp_path / "marker").exists()


def test_diffusers_loads_are_told_to_use_safetensors_only(pipe_dir):
    from unclip.nets.decoder import UnCLIPDecoder

    with pytest.raises(ValueError, match="never loads pickle weights"):
        UnCLIPDecoder.from_pretrained(pipe_dir / "decoder", use_safetensors=False)


# ----------------------------------------------------------------- broken JSON, truncated weights
def test_broken_pipeline_index_names_the_file(pipe_copy):
    from unclip.pipeline.folders import read_pipeline_index

    assert read_pipeline_index(pipe_copy)["components"]["decoder"] == "decoder"
    (pipe_copy / "unclip.json").write_text('{"components": {')
    with pytest.raises(ValueError) as err:
        read_pipeline_index(pipe_copy)
    msg = str(err.value)
    assert f"{pipe_copy / 'unclip.json'} is not valid JSON" in msg and "\n" not in msg


def test_broken_stage_meta_names_the_file(pipe_copy):
    from unclip.pipeline.pipeline import UnCLIPPipeline

    p = pipe_copy
    (p / "decoder" / "unclip_stage.json").write_text("{oops")
    with pytest.raises(ValueError, match=f"decoder: {p / 'decoder' / 'unclip_stage.json'} is not"):
        UnCLIPPipeline.from_components(p / "clip", p / "decoder")


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("component", ["clip", "prior", "decoder", "sr32"])
def test_truncated_safetensors_names_the_file(pipe_copy, component):
    from unclip.io.weights import load_weights
    from unclip.pipeline.pipeline import UnCLIPPipeline

    name = "model.safetensors" if component == "clip" else "diffusion_pytorch_model.safetensors"
    file = pipe_copy / component / name
    truncate(file)
    want = rf"{component if component != 'sr32' else 'upsampler'}: {file} is truncated or corrupt"
    with pytest.raises(ValueError, match=want + r".*re-download or re-export it"):
        UnCLIPPipeline.from_pretrained(pipe_copy)
    with pytest.raises(ValueError, match=rf"{file} is truncated or corrupt"):
        load_weights(pipe_copy / component, component)


# ------------------------------------------------------------------------------ unclip assemble
def assemble_args(p: Path, out: Path, *extra) -> list[str]:
    return [
        *("--clip", str(p / "clip"), "--prior", str(p / "prior")),
        *("--decoder", str(p / "decoder"), "--upsampler", str(p / "sr32")),
        *("--out", str(out), *extra),
    ]


def test_assemble_refuses_a_non_empty_out_and_overwrite_replaces_it_whole(pipe_dir, tmp_path):
    from unclip.cli.assemble import main as assemble

    out = tmp_path / "out"
    (out / "sr256").mkdir(parents=True)  # a stale stage of an earlier pipeline
    (out / "notes.txt").write_text("keep me unless --overwrite")
    with pytest.raises(ValueError, match=rf"--out {out} is not empty; pass --overwrite"):
        assemble(assemble_args(pipe_dir, out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sr256"]

    assert assemble(assemble_args(pipe_dir, out, "--overwrite")) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",  # the model card
        "clip",
        "decoder",
        "prior",
        "sr32",
        "unclip.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left

    with pytest.raises(ValueError, match="is a file"):
        assemble(assemble_args(pipe_dir, out / "unclip.json"))
    # the card says the license only when it is given
    assert "license:" not in (out / "README.md").read_text().split("---")[1]
    licensed = tmp_path / "licensed"
    assert assemble(assemble_args(pipe_dir, licensed, "--license", "mit")) == 0
    assert "license: mit" in (licensed / "README.md").read_text().split("---")[1]


def test_the_console_shows_python_warnings_on_one_line(capsys):
    """A library's warning reaches the command line as ``prog: warning: message``, without the
    file, line and source text Python prints (``--debug`` keeps those)."""
    import warnings

    from unclip.cli.errors import run_main

    def main(argv):
        warnings.warn("the folder holds an older card", UserWarning, stacklevel=1)
        return 0

    assert run_main("unclip assemble", main, []) == 0
    err = capsys.readouterr().err
    assert err == "unclip assemble: warning: the folder holds an older card\n"


def test_clip_fingerprint_survives_save_and_load_and_tells_clips_apart(pipe_dir, tmp_path):
    from unclip.eval.metrics import clip_fingerprint

    clip = CLIP.from_pretrained(pipe_dir / "clip")
    fp = clip.fingerprint()
    assert len(fp) == 16 and clip_fingerprint(clip) == fp
    clip.save_pretrained(tmp_path / "again", keep_tokens=[0, 5, 49406, 49407])
    kept = CLIP.from_pretrained(tmp_path / "again")
    assert kept.fingerprint() != fp  # other token rows: another CLIP
    kept.save_pretrained(tmp_path / "again2")
    assert CLIP.from_pretrained(tmp_path / "again2").fingerprint() == kept.fingerprint()
    torch.manual_seed(1)
    other = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config()))
    assert (
        other.fingerprint()
        != CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config(layers=1))).fingerprint()
    )


def test_components_must_match_the_clip_they_were_trained_with(pipe_copy, tmp_path):
    from unclip.pipeline.folders import stage_meta
    from unclip.pipeline.pipeline import UnCLIPPipeline

    p = pipe_copy
    clip = CLIP.from_pretrained(p / "clip")
    index = json.loads((p / "unclip.json").read_text())
    for name, kind in (("prior", "prior"), ("decoder", "decoder"), ("sr32", "upsampler")):
        meta = stage_meta(kind, name, index["diffusion"][name], index["sampling"][name], clip)
        (p / name / "unclip_stage.json").write_text(json.dumps(meta))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every component carries its fingerprint: no warning
        UnCLIPPipeline.from_components(p / "clip", p / "decoder", p / "prior", [p / "sr32"])

    torch.manual_seed(1)  # another CLIP of the same dimensions, as from another run
    CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config())).save_pretrained(
        tmp_path / "other"
    )
    other = CLIP.from_pretrained(tmp_path / "other").fingerprint()
    with pytest.raises(ValueError) as err:
        UnCLIPPipeline.from_components(tmp_path / "other", p / "decoder", p / "prior")
    msg = str(err.value)
    assert f"prior {p / 'prior'} was trained with CLIP {clip.fingerprint()}" in msg
    assert other in msg and "\n" not in msg

    # an older export without the key still loads, with a warning
    import shutil

    loose = Path(shutil.copytree(p / "decoder", tmp_path / "loose" / "decoder"))
    meta = json.loads((loose / "unclip_stage.json").read_text())
    del meta["clip_fingerprint"]
    (loose / "unclip_stage.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=f"{loose}: no clip_fingerprint recorded"):
        UnCLIPPipeline.from_components(tmp_path / "other", loose)

    # an upsampler does not read the CLIP: none is recorded, and one an older export recorded
    # (here another CLIP's) is not held against the pipeline's CLIP
    assert "clip_fingerprint" not in json.loads((p / "sr32" / "unclip_stage.json").read_text())
    up = Path(shutil.copytree(p / "sr32", tmp_path / "up" / "sr32"))
    meta = json.loads((up / "unclip_stage.json").read_text())
    (up / "unclip_stage.json").write_text(json.dumps({**meta, "clip_fingerprint": other}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = UnCLIPPipeline.from_components(p / "clip", p / "decoder", p / "prior", [up])
    assert len(pipe.upsamplers) == 1


# ----------------------------------------------------------------------------- unclip embed input
@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"source": "webdatset"}, ValueError, "unknown --source 'webdatset'"),
        ({"data": "{tmp}/nope"}, ValueError, "image folder {tmp}/nope does not exist"),
        (
            {"source": "webdataset", "data": "{tmp}/{{00000..00001}}.tar"},
            FileNotFoundError,
            "--data: tar shard {tmp}/00000.tar not found",
        ),
        ({"source": "webdataset", "data": None}, ValueError, "--source webdataset needs --data"),
        ({"clip_config": "{tmp}/nope.yaml"}, FileNotFoundError, "--clip-config {tmp}/nope.yaml"),
        ({"clip_config": "{tmp}/bad.yaml"}, ValueError, "not a valid YAML file"),
        ({"clip_config": "{tmp}/list.yaml"}, ValueError, "expected a YAML mapping"),
        ({"out": "{tmp}/file.txt"}, ValueError, "--out {tmp}/file.txt is a file"),
        ({"out": "{tmp}/file.txt/sub"}, ValueError, "file.txt is a file, not a folder"),
    ],
)
def test_embed_bad_options_fail_in_one_line_before_any_work(tmp_path, change, error, message):
    import time

    (tmp_path / "images").mkdir()
    write_shapes(tmp_path / "images", 2, resolution=16, format="folder", progress=False)
    (tmp_path / "bad.yaml").write_text("clip: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- clip\n")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "clip.yaml").write_text("clip: {model_name: tiny}\n")
    fields = dict(
        source="folder",
        clip_config=str(tmp_path / "clip.yaml"),
        out=str(tmp_path / "out"),
        data=str(tmp_path / "images"),
        progress=False,
    )
    fields.update({k: v.format(tmp=tmp_path) if v else v for k, v in change.items()})
    before = sorted(tmp_path.rglob("*"))
    start = time.monotonic()
    with pytest.raises(error) as err:
        embed.embed(embed.EmbedJob(**fields))
    assert time.monotonic() - start < 5  # refused before a model or Accelerator is built
    assert message.format(tmp=tmp_path) in str(err.value) and "\n" not in str(err.value)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written
