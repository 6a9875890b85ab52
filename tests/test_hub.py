"""Hugging Face Hub repo ids (unclip/hub.py) through the real ``huggingface_hub``, offline: a Hub
cache laid out on disk as ``huggingface_hub`` lays it out (``hub_cache`` in conftest.py), with
``HF_HUB_OFFLINE=1`` and every network connection refused."""

import json
import shutil

import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import OfflineModeIsEnabled
from safetensors.torch import load_file, save_file

from unclip.cli.errors import run_main
from unclip.cli.evaluate import main as evaluate
from unclip.cli.generate import main as generate
from unclip.io.hub import ModelNotFoundError, upload_folder_of
from unclip.nets.clip import CLIP
from unclip.nets.decoder import UnCLIPDecoder
from unclip.nets.prior import UnCLIPPrior
from unclip.pipeline.pipeline import UnCLIPPipeline

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"prior": {"steps": 2, "best_of": 1}, "decoder": {"steps": 2}, "upsampler": {"steps": 2}}


def images(pipe, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return pipe(
        "a red circle", generator=gen, sampling=FAST, output_type="pt", progress=False
    ).images


@pytest.fixture(scope="module")
def saved(tiny_pipe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "pipe"
    tiny_pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def local(saved):
    """The saved pipeline loaded from its folder (an in-memory pipeline and a loaded one differ by
    float rounding: the loaded weights' memory layout differs)."""
    return UnCLIPPipeline.from_pretrained(saved)


def copy_of(saved, tmp_path, name="copy"):
    return shutil.copytree(saved, tmp_path / name)


# ------------------------------------------------------------------------------------------ load
def test_pipeline_loads_from_the_hub_cache_offline(hub_cache, saved, local, tmp_path):
    hub_cache("org/tiny", saved)
    pipe = UnCLIPPipeline.from_pretrained("org/tiny")  # the default cache (HF_HUB_CACHE)
    assert pipe.stage_names == local.stage_names
    assert torch.equal(images(pipe), images(local))
    # cache_dir is where the snapshot is looked for
    moved = shutil.copytree(hub_cache.cache, tmp_path / "moved", symlinks=True)
    shutil.rmtree(hub_cache.cache)
    again = UnCLIPPipeline.from_pretrained("org/tiny", cache_dir=moved)
    assert torch.equal(images(again), images(local))
    with pytest.raises(ModelNotFoundError, match="org/tiny"):
        UnCLIPPipeline.from_pretrained("org/tiny")


def test_revision_selects_a_branch_tag_or_commit(hub_cache, saved, tmp_path):
    main = hub_cache("org/tiny", saved)
    v1 = copy_of(saved, tmp_path, "v1")
    index = json.loads((v1 / "unclip.json").read_text())
    index["sampling"]["decoder"]["steps"] = 7
    (v1 / "unclip.json").write_text(json.dumps(index))
    tagged = hub_cache("org/tiny", v1, ref="v1")
    assert tagged != main
    assert UnCLIPPipeline.from_pretrained("org/tiny").sampling["decoder"].steps == 4
    assert UnCLIPPipeline.from_pretrained("org/tiny", revision="v1").sampling["decoder"].steps == 7
    by_commit = UnCLIPPipeline.from_pretrained("org/tiny", revision=main)
    assert by_commit.sampling["decoder"].steps == 4
    with pytest.raises(ModelNotFoundError, match=r"org/tiny \(revision v2\)") as e:
        UnCLIPPipeline.from_pretrained("org/tiny", revision="v2")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="revision applies to Hub repo ids only"):
        UnCLIPPipeline.from_pretrained(saved, revision="v1")


def test_an_id_neither_a_folder_nor_cached_is_one_clear_line(hub_cache, monkeypatch, capsys):
    with pytest.raises(ModelNotFoundError) as e:
        UnCLIPPipeline.from_pretrained("org/missing")
    msg = str(e.value)
    assert "\n" not in msg and "org/missing" in msg and "HF_HUB_OFFLINE" in msg
    assert isinstance(e.value, FileNotFoundError)
    # local_files_only keeps to the cache with the network allowed (the guard still refuses it)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ModelNotFoundError, match="local_files_only=True"):
        UnCLIPPipeline.from_pretrained("org/missing", local_files_only=True)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    # the command line prints it as its one error line
    argv = ["a red circle", "--model", "org/missing", "--out", "unused", "--no-progress"]
    assert run_main("unclip generate", generate, argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("unclip generate: error: pipeline org/missing: no such folder")
    assert "\n" not in err
    # a path that cannot be a repo id is never looked up
    with pytest.raises(ModelNotFoundError, match="pipeline folder not found: ./org/missing"):
        UnCLIPPipeline.from_pretrained("./org/missing")


def _malicious_pickle(path, marker):
    """A pickle that creates ``marker`` when unpickled."""

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"weight": Payload()}, path)


def test_a_repo_with_only_pickle_weights_is_refused(hub_cache, saved, tmp_path):
    repo = copy_of(saved, tmp_path)
    (repo / "decoder" / "diffusion_pytorch_model.safetensors").unlink()
    marker = tmp_path / "pwned"
    _malicious_pickle(repo / "decoder" / "diffusion_pytorch_model.bin", marker)
    hub_cache("org/pickled", repo)
    match = r"only pickle weights \(decoder/diffusion_pytorch_model\.bin\)"
    with pytest.raises(ValueError, match=match) as e:
        UnCLIPPipeline.from_pretrained("org/pickled")
    assert "safetensors" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="pickle"):
        UnCLIPDecoder.from_pretrained("org/pickled", subfolder="decoder")
    # beside a safetensors variant, the error says how to load that instead
    shutil.copy(saved / "decoder" / "diffusion_pytorch_model.safetensors", tmp_path / "w")
    shutil.move(tmp_path / "w", repo / "decoder" / "diffusion_pytorch_model.fp16.safetensors")
    hub_cache("org/pickled-and-fp16", repo)
    with pytest.raises(ValueError, match='pass variant="fp16"'):
        UnCLIPPipeline.from_pretrained("org/pickled-and-fp16")
    assert not marker.exists()


def test_components_load_from_a_pipeline_repo(hub_cache, saved, tiny_pipe):
    hub_cache("org/tiny", saved)
    dec = UnCLIPDecoder.from_pretrained("org/tiny", subfolder="decoder", torch_dtype=torch.bfloat16)
    assert dec.dtype == torch.bfloat16 and dec.config._name_or_path == "org/tiny"
    want = tiny_pipe.decoder.state_dict()
    assert all(torch.equal(v, want[k].bfloat16()) for k, v in dec.state_dict().items())
    prior = UnCLIPPrior.from_pretrained("org/tiny", subfolder="prior", torch_dtype=torch.float16)
    assert prior.dtype == torch.float16
    assert prior.transformer.clip_std.dtype == torch.float32  # diffusers' loader keeps the list
    clip = CLIP.from_pretrained("org/tiny", subfolder="clip")
    assert clip.fingerprint() == tiny_pipe.clip.fingerprint()
    with pytest.raises(ModelNotFoundError, match="decoder org/nothing"):
        UnCLIPDecoder.from_pretrained("org/nothing", subfolder="decoder")


def test_variant_reads_the_variant_weights(hub_cache, saved, tiny_pipe, tmp_path):
    repo = copy_of(saved, tmp_path)
    for comp in ["clip", *tiny_pipe.stage_names]:
        name = "model" if comp == "clip" else "diffusion_pytorch_model"
        state = load_file(repo / comp / f"{name}.safetensors")
        half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
        save_file(half, repo / comp / f"{name}.fp16.safetensors")
    hub_cache("org/variants", repo)
    plain = UnCLIPPipeline.from_pretrained("org/variants")
    fp16 = UnCLIPPipeline.from_pretrained("org/variants", variant="fp16")
    for name, module in fp16.modules().items():
        want = plain.modules()[name].state_dict()
        for key, value in module.state_dict().items():
            assert value.dtype == want[key].dtype  # loaded into the float32 model
            if value.is_floating_point():
                assert torch.equal(value, want[key].half().to(value.dtype)), (name, key)
    assert not torch.equal(fp16.decoder.unet.conv_in.weight, plain.decoder.unet.conv_in.weight)
    with pytest.raises((ValueError, OSError), match="bf16"):
        UnCLIPPipeline.from_pretrained("org/variants", variant="bf16")


# ------------------------------------------------------------------------------- command line
def test_generate_and_evaluate_take_a_repo_id_and_revision(hub_cache, saved, tmp_path):
    hub_cache("org/tiny", saved, ref="v1")
    out = tmp_path / "g"
    argv = ["a red circle", "--model", "org/tiny", "--revision", "v1", "--out", str(out)]
    assert generate([*argv, "--decoder-steps", "2", "--upsampler-steps", "2", "--no-progress"]) == 0
    record = json.loads((out / "generate.json").read_text())
    assert record["model"] == "org/tiny" and record["revision"] == "v1"
    assert len(record["files"]) == 1
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    argv = ["--model", "org/tiny", "--revision", "v1", "--cache-dir", str(hub_cache.cache)]
    argv += ["--prompts", str(prompts), "--out", str(tmp_path / "e"), "--resolution", "64"]
    assert evaluate([*argv, "--sampling", json.dumps(FAST), "--no-progress"]) == 0
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert report["model"] == "org/tiny" and report["revision"] == "v1"
    assert report["num_samples"] == 2


# ------------------------------------------------------------------------------------- upload
def test_push_uploads_the_saved_folder_with_its_card(tiny_pipe, local, tmp_path):
    folder = upload_folder_of(tiny_pipe._push_writer("me/tiny-unclip"), tmp_path / "up")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    comps = ["clip/model.safetensors"] + [
        f"{s}/diffusion_pytorch_model.safetensors" for s in tiny_pipe.stage_names
    ]
    configs = [f"{c}/config.json" for c in ["clip", *tiny_pipe.stage_names]]
    assert files == sorted(["README.md", "unclip.json", *comps, *configs])
    card = ModelCard.load(folder / "README.md")
    assert 'UnCLIPPipeline.from_pretrained("me/tiny-unclip")' in card.text
    assert "--model me/tiny-unclip" in card.text
    loaded = UnCLIPPipeline.from_pretrained(folder)
    assert torch.equal(images(loaded), images(local))


def test_push_offline_fails_before_saving(hub_cache, tiny_pipe, monkeypatch):
    saves = []
    monkeypatch.setattr(tiny_pipe, "save_pretrained", lambda *a, **k: saves.append(a))
    with pytest.raises(OfflineModeIsEnabled, match="offline mode is enabled"):
        tiny_pipe.push_to_hub("me/tiny-unclip")
    with pytest.raises(OfflineModeIsEnabled):
        tiny_pipe.clip.push_to_hub("me/tiny-clip")
    assert saves == []
