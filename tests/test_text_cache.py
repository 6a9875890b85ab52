"""The priors' cache of caption encodings (train.text_cache_mb): exact, bounded, used."""

import pytest
import torch
from conftest import CONFIGS

from unclip.train.config import load_stage_config
from unclip.train.text_cache import TextEncodingCache
from unclip.utils.config import ConfigError

CAPTIONS = [
    "a red circle on the left",
    "a big blue square in the center",
    "two green triangles",
    "a yellow star at the top",
    "a small purple square to the right of a red circle",
]


def rows(enc, i):
    return enc.text_embed[i], enc.text_tokens[i], enc.text_mask[i]


def assert_rows_equal(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_cached_encodings_are_what_a_full_batch_of_the_chunk_size_gives(tiny_clip):
    cache = TextEncodingCache(tiny_clip, chunk=4, max_mb=1)
    first = CAPTIONS[:4]
    got = cache.encode_text(first)
    fresh = tiny_clip.encode_text(first)
    for i in range(4):
        assert_rows_equal(rows(got, i), rows(fresh, i))
    assert (cache.served, cache.encoded, len(cache)) == (4, 4, 4)
    assert cache.encoded_rows == 8  # the batch, and once in reverse to check rows are exact

    # a batch in another order with one new caption (twice): only the new one is encoded, padded
    # to the chunk size, and every row is the encoding a fresh full batch gives it
    batch = [CAPTIONS[4], CAPTIONS[2], CAPTIONS[4], CAPTIONS[0]]
    got = cache.encode_text(batch)
    assert (cache.served, cache.encoded, len(cache)) == (8, 5, 5)
    assert cache.encoded_rows == 12  # one caption missing: a padded batch of 4
    new = tiny_clip.encode_text([CAPTIONS[4], CAPTIONS[1], CAPTIONS[3], CAPTIONS[0]])
    assert_rows_equal(rows(got, 0), rows(new, 0))
    assert_rows_equal(rows(got, 2), rows(new, 0))
    assert_rows_equal(rows(got, 1), rows(fresh, 2))
    assert_rows_equal(rows(got, 3), rows(fresh, 0))
    # the premise: within a batch of fixed shape, a row does not depend on the other rows
    assert_rows_equal(rows(new, 3), rows(fresh, 0))


def test_the_cache_keeps_at_most_its_budget_and_drops_the_least_recently_used(tiny_clip):
    probe = TextEncodingCache(tiny_clip, chunk=1, max_mb=1)
    probe.encode_text(CAPTIONS[:1])
    row_bytes = probe.bytes
    assert row_bytes > 0
    cache = TextEncodingCache(tiny_clip, chunk=1, max_mb=2.5 * row_bytes / 2**20)
    a, b, c, d = CAPTIONS[:4]
    cache.encode_text([a, b])
    cache.encode_text([a])  # a is now the most recent
    cache.encode_text([c])  # over budget: b goes
    assert list(cache.rows) == [a, c] and cache.bytes == 2 * row_bytes <= cache.max_bytes
    cache.encode_text([a, c])
    assert cache.encoded == 3  # both served from the cache
    cache.encode_text([d, b])
    assert list(cache.rows) == [d, b] and cache.encoded == 5


def test_the_cache_turns_itself_off_where_rows_depend_on_their_position(tiny_clip, caplog):
    """On a device whose kernels round a row by its position in the batch, cached rows would not
    be exact: the first encoding notices, warns and stops caching."""
    encode = tiny_clip.encode_text

    def by_position(captions):  # a row's last bits depend on its position, as some GEMMs'
        enc = encode(captions)
        enc.text_embed = enc.text_embed + 1e-6 * torch.arange(len(enc))[:, None]
        return enc

    class Shifted:
        encode_text = staticmethod(by_position)

    cache = TextEncodingCache(Shifted(), chunk=4, max_mb=1)
    with caplog.at_level("WARNING", logger="unclip.train"):
        got = cache.encode_text(CAPTIONS[:3])
    assert "turned off" in caplog.text
    assert cache.max_bytes == 0 and len(cache) == 0
    assert torch.equal(got.text_embed, by_position(CAPTIONS[:3]).text_embed)
    cache.encode_text(CAPTIONS[:3])
    assert len(cache) == 0 and cache.encoded == 6


def test_no_cache_encodes_every_caption(tiny_clip):
    cache = TextEncodingCache(tiny_clip, chunk=2, max_mb=0)
    got = cache.encode_text(CAPTIONS[:3])
    got = cache.encode_text(CAPTIONS[:3])
    assert (cache.encoded, len(cache)) == (6, 0)
    assert_rows_equal(rows(got, 2), rows(tiny_clip.encode_text(CAPTIONS[:3]), 2))
    # one string is one caption; token ids go to the CLIP uncached
    assert len(TextEncodingCache(tiny_clip, chunk=2, max_mb=1).encode_text(CAPTIONS[0])) == 1
    ids = tiny_clip.tokenize(CAPTIONS[:2])
    assert torch.equal(cache.encode_text(ids).text_embed, tiny_clip.encode_text(ids).text_embed)
    with pytest.raises(ValueError, match="chunk"):
        TextEncodingCache(tiny_clip, chunk=0, max_mb=1)


def test_prior_training_loss_is_the_same_with_and_without_the_cache():
    from unclip.nets.clip import CLIP
    from unclip.train.data.loader import make_batches
    from unclip.train.loop import sample_generators
    from unclip.train.prior import PriorTask, build_prior_model

    def task_and_model(*overrides):
        cfg = load_stage_config(CONFIGS / "tiny" / "prior.yaml", list(overrides))
        torch.manual_seed(0)
        clip = CLIP.from_config(cfg.clip)
        return cfg, clip, PriorTask(cfg, clip, "cpu"), build_prior_model(cfg, clip)

    cfg, clip, cached, model = task_and_model()
    *_, plain, _ = task_and_model("train.text_cache_mb=0")
    batch = next(
        iter(make_batches(cfg.data, resolution=clip.image_size, seed=0, rank=0, world_size=1))
    )
    losses = []
    with torch.no_grad():
        for task in (cached, cached, plain):
            losses.append(
                task.loss(model, batch, sample_generators(3, 0, 0, len(batch["caption"])))
            )
    assert losses[0] == losses[1] == losses[2]
    # the second call took every caption from the cache; without the cache each is encoded
    n = len(batch["caption"])
    assert cached.text.served == 2 * n and cached.text.encoded == len(set(batch["caption"]))
    assert plain.text.encoded == n and len(plain.text) == 0


def test_text_cache_mb_must_not_be_negative():
    with pytest.raises(ConfigError, match="train.text_cache_mb"):
        load_stage_config(CONFIGS / "tiny" / "prior.yaml", ["train.text_cache_mb=-1"])
