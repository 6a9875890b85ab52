import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="session")
def tiny_pipe():
    from unclip.tiny import tiny_pipeline

    return tiny_pipeline(seed=0)


@pytest.fixture(scope="session")
def tiny_clip(tiny_pipe):
    return tiny_pipe.clip


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


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
    from unclip.clip import CLIP, tiny_clip_config
    from unclip.config import ClipConfig

    torch.manual_seed(0)
    clip = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config()))
    path = tmp_path_factory.mktemp("clip")
    clip.save_pretrained(path)
    return path
