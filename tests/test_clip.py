import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from unclip.nets.clip import CLIP, ClipConfig, tiny_clip_config
from unclip.nets.text_encoding import TextEncoding


def test_text_shapes_norms_and_masks(tiny_clip):
    prompts = ["a red circle", "a small blue square on the left on a gray background"]
    enc = tiny_clip.encode_text(prompts)
    D, L, W = tiny_clip.embed_dim, tiny_clip.context_length, tiny_clip.text_width
    assert enc.text_embed.shape == (2, D)
    assert enc.text_tokens.shape == (2, L, W)
    assert enc.text_mask.shape == (2, L) and enc.text_mask.dtype == torch.bool
    assert torch.allclose(enc.text_embed.norm(dim=-1), torch.ones(2), atol=1e-5)
    # mask covers start + words + end token exactly
    ids = tiny_clip.tokenize(prompts)
    for i, p in enumerate(prompts):
        n = len(tiny_clip.tokenizer.encode(p)) + 2
        assert enc.text_mask[i].sum() == n and enc.text_mask[i, :n].all()
        assert ids[i, n - 1] == tiny_clip.tokenizer.eot_token_id
    assert not torch.allclose(enc.text_embed[0], enc.text_embed[1])


def test_pooled_embedding_matches_open_clip(tiny_clip):
    ids = tiny_clip.tokenize(["a green triangle"])
    ours = tiny_clip.encode_text(["a green triangle"]).text_embed
    ref = torch.nn.functional.normalize(tiny_clip.model.encode_text(ids), dim=-1)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_truncation_warning_shows_cut_text(tiny_clip):
    long = " ".join(f"word{i}" for i in range(60)) + " finalword"
    with pytest.warns(UserWarning, match="truncated.*cut '.*finalword'"):
        enc = tiny_clip.encode_text([long])
    assert enc.text_mask.all()  # every position used
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_clip.encode_text(["short prompt"])  # no warning


def test_image_encoding_pil_and_tensor(tiny_clip):
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
    pil = Image.fromarray(arr)
    e_pil = tiny_clip.encode_image(pil)
    e_t = tiny_clip.encode_image(torch.from_numpy(arr).permute(2, 0, 1)[None].float() / 127.5 - 1)
    assert e_pil.shape == (1, tiny_clip.embed_dim)
    assert torch.allclose(e_pil.norm(dim=-1), torch.ones(1), atol=1e-5)
    assert torch.allclose(e_pil, e_t, atol=2e-3)  # same preprocessing on both paths at native size
    other = tiny_clip.encode_image(Image.fromarray(255 - arr))
    assert not torch.allclose(e_pil, other, atol=1e-3)


def test_bad_inputs(tiny_clip):
    with pytest.raises(TypeError, match="prompt must be a string"):
        tiny_clip.encode_text(3)
    with pytest.raises(TypeError, match=r"prompt\[1\] must be a string"):
        tiny_clip.encode_text(["ok", None])
    with pytest.raises(ValueError, match="empty"):
        tiny_clip.encode_text([])
    with pytest.raises(TypeError, match="PIL image"):
        tiny_clip.encode_image("not an image")
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        tiny_clip.encode_image(torch.zeros(1, 4, 8, 8))


def test_missing_local_weights_names_file(tmp_path):
    missing = tmp_path / "weights" / "clip.safetensors"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        CLIP.from_config(ClipConfig("tiny", pretrained=str(missing), model_cfg=tiny_clip_config()))
    with pytest.raises(ValueError, match="unknown open_clip model name"):
        CLIP.from_config(ClipConfig("not-a-model"))


def test_save_load_and_local_weights_file(tiny_clip, tmp_path):
    tiny_clip.save_pretrained(tmp_path / "clip")
    again = CLIP.from_pretrained(tmp_path / "clip")
    a = tiny_clip.encode_text(["a purple square"])
    b = again.encode_text(["a purple square"])
    assert torch.equal(a.text_embed, b.text_embed) and torch.equal(a.text_tokens, b.text_tokens)
    # the same weights as `clip.pretrained` (a local file) in a config
    c = CLIP.from_config(
        ClipConfig(
            "tiny",
            pretrained=str(tmp_path / "clip" / "model.safetensors"),
            model_cfg=tiny_clip.model_cfg,
        )
    )
    assert torch.equal(c.encode_text(["a purple square"]).text_embed, a.text_embed)
    assert not any(p.requires_grad for p in again.parameters())
    (tmp_path / "clip" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        CLIP.from_pretrained(tmp_path / "clip")


def test_closed_vocabulary_file_keeps_only_those_token_rows_and_encodes_them_exactly(
    tiny_clip, tmp_path
):
    from safetensors.torch import load_file

    from unclip.nets.clip import closed_vocabulary_ids
    from unclip.nets.clip_weights import KEPT_TOKENS_KEY
    from unclip.shapes.world import ShapesWorld, caption_vocabulary

    ids = closed_vocabulary_ids(tiny_clip, caption_vocabulary())
    assert {0, tiny_clip.tokenizer.sot_token_id, tiny_clip.tokenizer.eot_token_id} <= set(
        ids.tolist()
    )
    world = ShapesWorld(32, seed=4, split="all", two_object_prob=0.5)
    captions = [world[i].caption for i in range(400)]
    assert torch.isin(
        tiny_clip.tokenize(captions), ids
    ).all()  # the vocabulary covers every caption

    tiny_clip.save_pretrained(tmp_path / "full")
    tiny_clip.save_pretrained(tmp_path / "closed", keep_tokens=ids)
    state = load_file(str(tmp_path / "closed" / "model.safetensors"))
    assert torch.equal(state[KEPT_TOKENS_KEY], ids)
    assert state["token_embedding.weight"].shape == (len(ids), tiny_clip.text_width)
    full_size = (tmp_path / "full" / "model.safetensors").stat().st_size
    table_bytes = tiny_clip.model.token_embedding.weight.numel() * 4  # fp32
    assert (
        tmp_path / "closed" / "model.safetensors"
    ).stat().st_size < full_size - 0.9 * table_bytes

    closed = CLIP.from_pretrained(tmp_path / "closed")
    a, b = tiny_clip.encode_text(captions), closed.encode_text(captions)
    assert torch.equal(a.text_embed, b.text_embed) and torch.equal(a.text_tokens, b.text_tokens)
    images = torch.rand(3, 3, 32, 32) * 2 - 1
    assert torch.equal(tiny_clip.encode_image(images), closed.encode_image(images))
    with pytest.warns(UserWarning, match=r"closed vocabulary .*\['dog'\] are outside it"):
        out = closed.encode_text(["a red dog"])
    assert not torch.allclose(out.text_embed, tiny_clip.encode_text(["a red dog"]).text_embed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        closed.encode_text(captions[:5])  # no warning for known words

    closed.save_pretrained(tmp_path / "again")  # a closed CLIP saves its rows again
    assert (tmp_path / "again" / "model.safetensors").stat().st_size == (
        tmp_path / "closed" / "model.safetensors"
    ).stat().st_size
    with pytest.raises(ValueError, match="keep_tokens must be a non-empty set of token ids"):
        tiny_clip.save_pretrained(tmp_path / "bad", keep_tokens=[5, 49408])


def test_frozen_clip_is_another_name_of_clip():
    import unclip.nets.clip as clip_module

    assert clip_module.FrozenCLIP is CLIP
    import unclip

    assert unclip.FrozenCLIP is unclip.CLIP is CLIP
    model = clip_module.build_open_clip_model(tiny_clip_config())
    assert isinstance(model, torch.nn.Module) and model.token_embedding.weight.requires_grad


def test_text_encodings_concatenate_row_wise(tiny_clip):
    a = tiny_clip.encode_text(["a red circle"])
    b = tiny_clip.encode_text(["a blue square", "a green triangle"])
    both = TextEncoding.cat([a, b])
    assert len(both) == 3
    for got, parts in (
        (both.text_embed, (a.text_embed, b.text_embed)),
        (both.text_tokens, (a.text_tokens, b.text_tokens)),
        (both.text_mask, (a.text_mask, b.text_mask)),
    ):
        assert torch.equal(got[:1], parts[0]) and torch.equal(got[1:], parts[1])
    assert torch.equal(both[2].text_embed, b[1].text_embed)


def test_dropping_the_text_tower_keeps_the_image_embeddings():
    clip = CLIP.from_config(ClipConfig("tiny", model_cfg=tiny_clip_config()))
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    before = clip.encode_image(x)
    total = sum(p.numel() for p in clip.model.parameters())
    assert clip.drop_text_tower() is clip
    visual = sum(p.numel() for p in clip.model.visual.parameters())
    assert sum(p.numel() for p in clip.model.parameters()) < total
    # what is left is the image tower and the temperature
    assert sum(p.numel() for p in clip.model.parameters()) <= visual + 2
    torch.testing.assert_close(clip.encode_image(x), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="text tower was dropped"):
        clip.encode_text(["a red circle"])
