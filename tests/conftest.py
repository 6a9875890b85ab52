import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# a subprocess that dies of a native signal (SIGSEGV, SIGABRT) prints its Python stacks, so a
# failing multi-process test says where each rank was
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
#: from_pretrained's arguments for a pipeline that computes exactly as the one saved (full
#: precision, default layout): its defaults sample in bf16 on CPUs that run it natively and store
#: the image networks channels-last, both of which change results beyond bit equality
EXACT = {"autocast_dtype": None, "memory_format": None}
#: two local processes (gloo on CPU): the launch every multi-process test uses
TORCHRUN = [
    str(Path(sys.executable).with_name("torchrun")),
    "--standalone",
    "--nproc_per_node",
    "2",
]


@pytest.fixture(scope="session")
def tiny_pipe():
    from unclip.pipeline.tiny import tiny_pipeline

    return tiny_pipeline(seed=0)


@pytest.fixture(scope="session")
def tiny_clip(tiny_pipe):
    return tiny_pipe.clip


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def sample_tiny_prior(prior, clip, text, settings):
    """``sample_prior`` of ``prior`` on the encoded ``text`` without gradients: ``clip``'s empty
    caption as the guidance's null, x0 prediction, one generator seeded 0; ``(best,
    candidates)``."""
    from unclip.diffusion.config import DiffusionConfig
    from unclip.sampling.stages import sample_prior

    with torch.no_grad():
        return sample_prior(
            prior,
            text,
            lambda n: clip.encode_text([""] * n),
            settings,
            DiffusionConfig(prediction_type="sample"),
            generator=torch.Generator().manual_seed(0),
            progress=False,
        )


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is several times faster than two on a busy machine (module-wide)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def reset_accelerate():
    """Clear Accelerate's process-wide state after the test."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny random CLIP saved as a component folder."""
    from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config

    torch.manual_seed(0)
    clip = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config()))
    path = tmp_path_factory.mktemp("clip")
    clip.save_pretrained(path)
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face Hub cache in ``tmp_path``, laid out as ``huggingface_hub`` lays it
    out (``models--org--name/{blobs,refs,snapshots}``, snapshot files linked to their blobs), set
    as the default cache with ``HF_HUB_OFFLINE=1``; any attempt to open a network connection
    fails the test. Returns ``add(repo_id, folder, ref="main") -> commit``, which stores
    ``folder``'s files as a commit of ``repo_id`` and points ``refs/<ref>`` at it;
    ``add.cache`` is the cache folder."""
    import hashlib
    import socket

    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads both once, at import
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))

    def no_network(*args, **kwargs):
        raise AssertionError(f"a test tried to open a network connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)

    def add(repo_id: str, folder, ref: str = "main") -> str:
        folder = Path(folder)
        files = sorted(f for f in folder.rglob("*") if f.is_file())
        digest = hashlib.sha1(repo_id.encode())
        for f in files:
            digest.update(str(f.relative_to(folder)).encode() + f.read_bytes())
        commit = digest.hexdigest()
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        for f in files:
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / commit / f.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(os.path.relpath(blob, link.parent))
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        return commit

    add.cache = cache
    return add


@pytest.fixture(scope="session")
def token_parts(tmp_path_factory):
    """Folders of a tiny dVAE (16 px → 4 × 4 tokens), a tiny DALL-E transformer over its codes
    and two upsamplers 16 → 32 → 64 px exported as a training run does (``unclip_stage.json``
    with their diffusion and sampling settings): ``(root, [sr32 folder, sr64 folder])``, the
    tokenizer and transformer in ``root / "tokenizer"`` and ``root / "transformer"``. Random
    networks, no training; :func:`token_pipeline` builds a pipeline of them."""
    import json

    from unclip.diffusion.config import DiffusionConfig, diffusion_to_save
    from unclip.nets.decoder import UnCLIPUpsampler
    from unclip.nets.dvae import DVAEConfig
    from unclip.nets.token_components import TokenizerConfig, TokenModelConfig, save_component
    from unclip.nets.token_transformer import DalleConfig
    from unclip.pipeline.folders import STAGE_META_FILE, save_diffusers_component
    from unclip.pipeline.tiny import tiny_upsampler_kwargs

    root = tmp_path_factory.mktemp("token_parts")
    torch.manual_seed(0)
    dvae = DVAEConfig(image_size=16, num_codes=16, n_hid=4, blocks_per_group=1, n_init=8, groups=3)
    tok_cfg = TokenizerConfig("dvae", dvae=dvae)
    save_component(tok_cfg.build(), root / "tokenizer", "tokenizer", tok_cfg)
    dalle = DalleConfig(
        num_layers=1,
        width=8,
        num_heads=2,
        text_len=8,
        grid=4,
        text_vocab_size=49408,
        image_vocab_size=16,
        sparse_attention=False,
    )
    net_cfg = TokenModelConfig("dalle", dalle=dalle)
    save_component(net_cfg.build(), root / "transformer", "transformer", net_cfg)
    ups = []
    for lo, hi, steps in ((16, 32, 2), (32, 64, 1)):
        up = UnCLIPUpsampler(**tiny_upsampler_kwargs(lo, hi))
        with torch.no_grad():  # diffusers zero-inits output layers; perturb so outputs vary
            for p in up.parameters():
                p.add_(0.05 * torch.randn_like(p))
        folder = root / f"sr{hi}"
        save_diffusers_component(up, folder)
        meta = {
            "stage": "upsampler",
            "name": folder.name,
            "diffusion": diffusion_to_save(DiffusionConfig(prediction_type="v_prediction")),
            "sampling": {"scheduler": "ddim", "steps": steps, "guidance_scale": 1.0},
        }
        (folder / STAGE_META_FILE).write_text(json.dumps(meta))
        ups.append(folder)
    return root, ups


def token_pipeline(token_parts, upsamplers: bool = True):
    """A fresh tiny DALL-E pipeline of the :func:`token_parts` folders (16 px, or 64 px through
    both upsamplers)."""
    from unclip.pipeline.token_pipeline import TokenPipeline

    root, ups = token_parts
    return TokenPipeline.from_components(
        root / "tokenizer", root / "transformer", upsamplers=ups if upsamplers else ()
    )
