"""GPTDataset / BlendedDataset index properties on real text, and a reference rebuild of
Megatron-Core's index algorithm written independently from docs/FORMATS.md 2b."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from megatron.config import DataConfig
from megatron.config.datasets import gpt_dataset_config
from megatron.data.gpt_dataset import (GPTDataset, GPTDatasetConfig, build_gpt_indices,
                                       build_train_valid_test_datasets)
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.utils import Split

EOD = 256
TOKENIZER = types.SimpleNamespace(eod=EOD, vocab_size=257)


def _build(data: DataConfig, tokenizer, sizes: list[int], seed: int) -> list:
    """The datasets pretrain_gpt.py's datasets_provider builds for these flags."""
    return build_train_valid_test_datasets(gpt_dataset_config(data, tokenizer, seed), sizes)


def _make_dataset(prefix, docs: list[bytes]) -> None:
    """Bytes-as-tokens preprocessing (+EOD per document) through our builder."""
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        tokens = np.append(np.frombuffer(d, np.uint8).astype(np.uint16), EOD)
        b.add_document(tokens, [len(tokens)])
    b.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_bytes()[:200_000]
    docs = [d for d in text.split(b"\n\n")]
    _make_dataset(root / "shakes", docs)
    _make_dataset(root / "small", docs[:7])  # tiny: needs many epochs
    _make_dataset(root / "other", docs[1::3])
    return root


# --------------------------------------------------------------------------------------------
# Independent reference (docs/FORMATS.md 2b), plain Python loops
# --------------------------------------------------------------------------------------------

def reference_indices(lengths, docs, num_samples, seq, seed):
    tokens = sum(int(lengths[d]) for d in docs)
    epochs = 1
    while epochs * tokens < num_samples * seq + 1:
        epochs += 1
    separate = False
    sans = 0
    if epochs > 1:
        sans = ((epochs - 1) * tokens - 1) // seq
        per_epoch = (tokens - 1) // seq
        separate = (num_samples - sans) < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)
    if separate:
        first = np.array(list(docs) * (epochs - 1), dtype=np.int32)
        rs.shuffle(first)
        last = np.array(list(docs), dtype=np.int32)
        rs.shuffle(last)
        doc_index = np.concatenate([first, last])
    else:
        doc_index = np.array(list(docs) * epochs, dtype=np.int32)
        rs.shuffle(doc_index)
    n = (epochs * tokens - 1) // seq
    rows = [(0, 0)]
    d, off = 0, 0
    for _ in range(n):
        remaining = seq + 1
        while True:
            left = int(lengths[doc_index[d]]) - off
            if left >= remaining:
                off += remaining - 1
                break
            remaining -= left
            d, off = d + 1, 0
        rows.append((d, off))
    sample = np.array(rows, dtype=np.int32)
    shuffle_first = np.arange(sans if separate else n, dtype=np.uint32)
    rs.shuffle(shuffle_first)
    shuffle = shuffle_first
    if separate:
        rest = np.arange(sans, n, dtype=np.uint32)
        rs.shuffle(rest)
        shuffle = np.concatenate([shuffle_first, rest])
    return doc_index, sample, shuffle, epochs


@pytest.mark.parametrize("prefix,num_samples,seq", [
    ("shakes", 500, 64), ("shakes", 2500, 100), ("shakes", 6000, 64), ("small", 300, 32),
    ("small", 1, 128), ("shakes", 1, 33)])
def test_matches_reference(corpus, prefix, num_samples, seq):
    ds = IndexedDataset(corpus / prefix)
    docs = np.arange(3, len(ds) - 2, dtype=np.int32)
    ref = reference_indices(ds.sizes, docs, num_samples, seq, 1234)
    for use_cpp in (None, False):
        got = build_gpt_indices(ds.sizes, docs, num_samples, seq, 1234, use_cpp=use_cpp)
        np.testing.assert_array_equal(got["document_index"], ref[0])
        assert got["document_index"].dtype == np.int32
        np.testing.assert_array_equal(got["sample_index"], ref[1])
        assert got["shuffle_index"].dtype == np.uint32
        np.testing.assert_array_equal(got["shuffle_index"], ref[2])


def _config(tmp_path, **kw):
    base = dict(random_seed=1234, sequence_length=64, tokenizer=TOKENIZER, split="90,8,2",
                path_to_cache=str(tmp_path / "cache"))
    base.update(kw)
    prefix = base.pop("prefix")
    return GPTDatasetConfig(blend=([str(prefix)], None), **base)


def _gpt(corpus, tmp_path, prefix="shakes", num_samples=1000, which=Split.train, **kw):
    cfg = _config(tmp_path, prefix=corpus / prefix, **kw)
    low = IndexedDataset(corpus / prefix)
    from megatron.data.utils import split_indices

    idx = split_indices(cfg.split_matrix[which.value], len(low))
    return GPTDataset(low, str(corpus / prefix), idx, num_samples, which, cfg), low, idx


def test_tokens_used_once_per_epoch_and_contiguous(corpus, tmp_path):
    ds, low, idx = _gpt(corpus, tmp_path, num_samples=200)
    # one epoch: each split document exactly once in the document index
    assert sorted(ds.document_index.tolist()) == idx.tolist()
    stream = np.concatenate([low[int(d)] for d in ds.document_index]).astype(np.int64)
    seq = 64
    n = len(ds)
    assert n == (len(stream) - 1) // seq  # every token (bar the remainder) used
    order = np.argsort(ds.shuffle_index)  # unshuffle: sample j is at order[j]
    for j in range(0, n, 7):
        s = ds[int(order[j])]
        text = torch.cat([s["tokens"], s["labels"][-1:]]).numpy()
        np.testing.assert_array_equal(text, stream[j * seq : j * seq + seq + 1])
    assert sorted(ds.shuffle_index.tolist()) == list(range(n))


def test_seed_determinism(corpus, tmp_path):
    a = _gpt(corpus, tmp_path / "a", num_samples=3000)[0]
    b = _gpt(corpus, tmp_path / "b", num_samples=3000)[0]
    c = _gpt(corpus, tmp_path / "c", num_samples=3000, random_seed=99)[0]
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert not np.array_equal(a.document_index, c.document_index)


def test_many_epochs_small_dataset(corpus, tmp_path):
    ds, low, idx = _gpt(corpus, tmp_path, prefix="small", num_samples=5000, split="1,0,0")
    tokens = int(low.sizes[idx].sum())
    epochs = -(-(5000 * 64 + 1) // tokens)
    assert epochs > 50 and len(ds) >= 5000
    assert len(ds.document_index) == epochs * len(idx)
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    assert ds[4999]["tokens"].shape == (64,)


def test_split_too_small_for_one_sample_names_split_and_flag(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"the valid split of .*small holds 0 documents, 0 "
                                         r"tokens: nothing to draw.*--split \(now 1000,1,0\)"):
        _gpt(corpus, tmp_path, prefix="small", num_samples=10, which=Split.valid,
             split="1000,1,0")
    assert not (tmp_path / "cache").exists()  # refused before any index build


def test_cache_reused(corpus, tmp_path, monkeypatch):
    a = _gpt(corpus, tmp_path, num_samples=20000)[0]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached indices were built again")

    monkeypatch.setattr("megatron.data.gpt_dataset.build_gpt_indices", no_rebuild)
    b = _gpt(corpus, tmp_path, num_samples=20000)[0]
    assert isinstance(b._mapped["sample_index"], np.memmap)  # loaded with mmap_mode='r'
    assert not b.sample_index.flags.owndata
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 4 and all(f.startswith(a.unique_description_hash + "-GPTDataset-train-")
                                   for f in files)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_default_cache_dir_and_builder(corpus, tmp_path):
    cfg = DataConfig(data_path=[str(corpus / "shakes")], seq_length=32, split="90,8,2")
    train, valid, test = _build(cfg, TOKENIZER, [100, 20, 5], 1)
    assert len(train) >= 100 and len(valid) >= 20 and len(test) >= 5
    assert (corpus / "shakes" / "cache" / "GPTDataset_indices").is_dir()


def test_masks(corpus, tmp_path):
    ds = _gpt(corpus, tmp_path, num_samples=50, eod_mask_loss=True, reset_position_ids=True,
              reset_attention_mask=True)[0]
    for i in range(20):
        s = ds[i]
        tokens = s["tokens"]
        eods = (tokens == EOD).nonzero().flatten().tolist()
        # reference: Megatron's loop
        mask = torch.tril(torch.ones(64, 64))
        pos = torch.arange(64)
        prev = 0
        for e in eods:
            mask[e + 1 :, : e + 1] = 0
            pos[e + 1 :] -= e + 1 - prev
            prev = e + 1
        assert torch.equal(s["attention_mask"][0], mask < 0.5)
        assert torch.equal(s["position_ids"], pos)
        assert torch.equal(s["loss_mask"], (tokens != EOD).float())
    plain = _gpt(corpus, tmp_path / "p", num_samples=50)[0][3]
    assert plain["loss_mask"].sum() == 64 and torch.equal(plain["position_ids"], torch.arange(64))


def test_blending_follows_weights(corpus, tmp_path):
    cfg = DataConfig(data_path=["0.3", str(corpus / "shakes"), "0.7", str(corpus / "other")],
                     seq_length=64, split="98,2,0", data_cache_path=str(tmp_path / "c"))
    train, valid, test = _build(cfg, TOKENIZER, [3000, 100, 0], 7)
    assert test is None
    for ds, size in ((train, 3000), (valid, 100)):
        di = np.asarray(ds.dataset_index)
        assert di.dtype == np.int16 and ds.dataset_sample_index.dtype == np.int64
        counts = np.cumsum(np.eye(2, dtype=np.int64)[di], axis=0)  # [k, 2] counts after k+1
        k = np.arange(1, len(di) + 1)[:, None]
        assert np.abs(counts - np.array([0.3, 0.7]) * k).max() <= 1.0
        assert len(ds) == int(np.ceil(size * 0.3)) + int(np.ceil(size * 0.7))
        # each component sample used at most once, in order
        for i in range(2):
            assert ds.dataset_sample_index[di == i].tolist() == list(range((di == i).sum()))
    s = train[5]
    assert s["dataset_id"] in (0, 1) and s["tokens"].shape == (64,)
    again = _build(cfg, TOKENIZER, [3000, 100, 0], 7)[0]
    assert isinstance(again.dataset_index, np.memmap)
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)


def test_per_split_paths_and_mock(corpus, tmp_path):
    cfg = DataConfig(train_data_path=[str(corpus / "shakes")],
                     valid_data_path=[str(corpus / "small"), str(corpus / "other")],
                     seq_length=64, data_cache_path=str(tmp_path / "c"))
    train, valid, test = _build(cfg, TOKENIZER, [100, 10, 10], 1)
    assert len(train) >= 100 and len(valid) == 10 and test is None
    mock = DataConfig(mock_data=True, seq_length=64)
    train, valid, test = _build(mock, TOKENIZER, [10, 5, 5], 1)
    s = train[0]
    assert s["tokens"].shape == (64,) and len(train) >= 10


def test_missing_prefix_errors(tmp_path):
    cfg = DataConfig(data_path=[str(tmp_path / "nothing")], seq_length=64)
    with pytest.raises(ValueError, match="nothing"):
        _build(cfg, TOKENIZER, [10, 1, 1], 1)
    with pytest.raises(ValueError, match="--split"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["x"], None), split="1,2,3,4")


# --------------------------------------------------------------------------------------------
# Mock data and token ids against the vocabulary
# --------------------------------------------------------------------------------------------

def test_mock_ids_stay_below_a_small_vocab():
    from megatron.data.gpt_dataset import MockGPTLowLevelDataset

    tok = types.SimpleNamespace(eod=99, vocab_size=100)  # NullTokenizer --vocab-size 99
    low = MockGPTLowLevelDataset(tok)
    for i in range(0, 2000, 37):
        doc = low[i]
        assert doc.max() < 100 and doc.min() >= 1 and doc[-1] == 99
        assert (doc[:-1] != 99).all()
        np.testing.assert_array_equal(low.get(i, 3, 5), doc[3:8])
    mock = DataConfig(mock_data=True, seq_length=512)
    train = _build(mock, tok, [10, 5, 5], 1)[0]
    assert max(int(train[i]["tokens"].max()) for i in range(10)) < 100
    with pytest.raises(ValueError, match="--vocab-size"):
        MockGPTLowLevelDataset(types.SimpleNamespace(eod=1, vocab_size=2))


@pytest.mark.parametrize("vocab_size", [4096, 50257])
def test_mock_ids_are_megatron_cores_for_vocab_4096_and_up(vocab_size):
    from megatron.data.gpt_dataset import MockGPTLowLevelDataset

    tok = types.SimpleNamespace(eod=vocab_size - 1, vocab_size=vocab_size)
    low = MockGPTLowLevelDataset(tok)
    lengths = np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)
    np.testing.assert_array_equal(low.sequence_lengths, lengths)
    longest = int(np.argmax(lengths))
    for i in (0, 1, 17, longest):
        expected = np.concatenate([np.arange(lengths[i] - 1) + 1, [vocab_size - 1]])
        np.testing.assert_array_equal(low[i], expected)


def test_ids_beyond_padded_vocab_are_an_error(corpus, tmp_path):
    cfg = DataConfig(data_path=[str(corpus / "shakes")], seq_length=32, split="90,8,2",
                     data_cache_path=str(tmp_path / "c"))
    small = types.SimpleNamespace(eod=100, vocab_size=101, padded_vocab_size=128, name="GPT2 BPE")
    with pytest.raises(ValueError, match=r"shakes holds token id 256.*GPT2 BPE tokenizer"):
        _build(cfg, small, [100, 20, 5], 1)
    # ids up to 256 fit a padded vocabulary of 384 (dummy ids are valid embedding rows)
    padded = types.SimpleNamespace(eod=100, vocab_size=300, padded_vocab_size=384, name="x")
    assert len(_build(cfg, padded, [100, 20, 5], 1)[0]) >= 100


# --------------------------------------------------------------------------------------------
# Stale index caches
# --------------------------------------------------------------------------------------------

def _remade(corpus, root, docs_slice):
    text = (corpus / "shakes.bin").read_bytes()  # any bytes: re-made with other documents
    docs = [bytes(np.frombuffer(text, np.uint16)[i:i + 50].astype(np.uint8))
            for i in range(0, 40_000, 50)][docs_slice]
    _make_dataset(root / "data", docs)


def _train(root, cache, num_samples=400):
    cfg = DataConfig(data_path=[str(root / "data")], seq_length=64, split="90,8,2",
                     data_cache_path=str(cache))
    return _build(cfg, TOKENIZER, [num_samples, 0, 0], 5)[0]


def test_stale_cache_is_rebuilt(corpus, tmp_path, monkeypatch):
    from megatron.data import index_cache

    warnings = []
    monkeypatch.setattr(index_cache, "warn_rank_0", warnings.append)
    _remade(corpus, tmp_path, slice(0, 800))
    first = _train(tmp_path, tmp_path / "cache")
    assert first[0]["tokens"].shape == (64,) and not warnings
    _remade(corpus, tmp_path, slice(0, 300))  # same prefix, fewer (and other) documents
    again = _train(tmp_path, tmp_path / "cache")
    fresh = _train(tmp_path, tmp_path / "fresh-cache")
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(again, name), getattr(fresh, name))
    assert any("GPTDataset-train" in w for w in warnings)  # (and valid/test: one per split)
    assert all("does not match the dataset" in w and str(tmp_path / "cache") in w for w in warnings)
    for i in range(len(again)):
        assert again[i]["tokens"].shape == (64,)
    seen = len(warnings)
    assert _train(tmp_path, tmp_path / "cache").document_index.tolist() == \
        fresh.document_index.tolist() and len(warnings) == seen  # now valid: loaded, no warning


@pytest.mark.parametrize("change", ["fewer", "same-count-other-lengths"])
def test_stale_cache_on_other_rank_is_a_clear_error(corpus, tmp_path, monkeypatch, change):
    from megatron.data import index_cache

    _remade(corpus, tmp_path, slice(0, 800))
    _train(tmp_path, tmp_path / "cache")
    if change == "fewer":
        _remade(corpus, tmp_path, slice(0, 500))
    else:  # as many documents, each one token shorter: only the token counts change
        text = [bytes(IndexedDataset(tmp_path / "data")[i][:-2].astype(np.uint8))
                for i in range(800)]
        _make_dataset(tmp_path / "data", text)
    monkeypatch.setattr(index_cache, "_rank", lambda: 1)  # rank 0 did not rebuild (own disk)
    with pytest.raises(ValueError, match=r"cache.*GPTDataset-train-\*\.npy does not match.*delete"):
        _train(tmp_path, tmp_path / "cache")


def test_validate_gpt_indices_accepts_fresh_indices(corpus):
    from megatron.data.gpt_dataset import validate_gpt_indices

    ds = IndexedDataset(corpus / "small")
    docs = np.arange(len(ds), dtype=np.int32)
    for num_samples, drop_last in ((300, True), (1, True), (50, False), (None, True)):
        arrays = build_gpt_indices(ds.sizes, docs, num_samples, 32, 7, drop_last)
        assert validate_gpt_indices(arrays, ds.sizes, docs, num_samples, 32, drop_last) is None
    arrays = build_gpt_indices(ds.sizes, docs, None, 32, 7)
    assert "samples" in validate_gpt_indices(arrays, ds.sizes, docs, None, 20)
    assert "documents" in validate_gpt_indices(arrays, ds.sizes, docs[:-1], None, 32)
    shorter = np.array(ds.sizes)
    shorter[np.argmax(shorter)] = 1  # same documents, fewer tokens
    assert validate_gpt_indices(arrays, shorter, docs, None, 32) is not None


# --------------------------------------------------------------------------------------------
# Cache names: pinned to the md5s the code wrote before the dataset builder moved (they are
# Megatron-Core's names, so the two frameworks share caches)
# --------------------------------------------------------------------------------------------

_SHAKES_DESCRIPTION = """{
    "class": "GPTDataset",
    "dataset_path": "data/shakes",
    "num_samples": 100,
    "index_split": "train",
    "random_seed": 1234,
    "sequence_length": 64,
    "split": "90,8,2",
    "split_matrix": [
        [
            0,
            0.9
        ],
        [
            0.9,
            0.98
        ],
        [
            0.98,
            1.0
        ]
    ],
    "tokenizer": {
        "class": "SimpleNamespace"
    }
}"""


def test_cache_names_and_descriptions_are_pinned(corpus, tmp_path):
    from megatron.data.blended_dataset import BlendedDataset
    from megatron.data.utils import split_indices

    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=64, tokenizer=TOKENIZER,
                           split="90,8,2", path_to_cache=str(tmp_path), blend=(["x"], None))
    parts = []
    for name, n in (("shakes", 100), ("other", 200)):
        low = IndexedDataset(corpus / name)
        parts.append(GPTDataset(low, f"data/{name}", split_indices(cfg.split_matrix[0], len(low)),
                                n, Split.train, cfg))
    blend = BlendedDataset(parts, [0.3, 0.7], 300, cfg)
    shakes, other = "46ee79348d3b46d5c0410183d990ebcf", "9643f892bb1ff2e3d8ef292373261a3b"
    blended = "a178a6c910d22911d148341fc054f8f0"
    assert (parts[0].unique_description_hash, parts[1].unique_description_hash,
            blend.unique_description_hash) == (shakes, other, blended)
    assert (tmp_path / f"{shakes}-GPTDataset-train-description.txt").read_text() == \
        _SHAKES_DESCRIPTION
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{h}-GPTDataset-train-{n}" for h in (shakes, other) for n in (
            "description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")]
        + [f"{blended}-BlendedDataset-train-{n}" for n in (
            "description.txt", "dataset_index.npy", "dataset_sample_index.npy")])
    mock = GPTDatasetConfig(random_seed=7, sequence_length=64, tokenizer=TOKENIZER)
    train = build_train_valid_test_datasets(mock, [100, 20, 5])[0]
    assert train.unique_description_hash == "f67312faf6b520531798069a57d397da"
