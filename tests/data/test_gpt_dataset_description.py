"""Our GPT dataset descriptions (``{md5}-GPTDataset-{split}-description.txt``, whose md5 names
every index cache file) are byte-identical to the ones Megatron-Core 0.13 writes for the same
run, so both frameworks reuse one cache directory.

The reference texts in ``megatron_core_gpt_descriptions.json`` were written by the real
megatron-core wheel (``megatron_core_gpt_descriptions_gen.py.txt``, run in a separate process
with Megatron-LM's tokenizer constructors) for GPT-2 BPE (vocab + merges), a HuggingFace
tokenizer directory and the NullTokenizer with mock data; paths are relative, as a user may
give them, so the md5s are pinned too. megatron-core is not needed here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDatasetConfig, build_train_valid_test_datasets
from megatron.data.indexed_dataset import IndexedDatasetBuilder

REFERENCE = json.loads((Path(__file__).parent / "megatron_core_gpt_descriptions.json")
                       .read_text())
PREFIX, VOCAB, MERGES, HF_DIR = ("corpus_text_document", "gpt2-vocab.json", "gpt2-merges.txt",
                                 "hf_gpt2")
# case: (config fields, samples per split) as the generator built them
CASES = {"gpt2bpe": (dict(random_seed=1234, sequence_length=32, blend=([PREFIX], None),
                          split="95,5,0"), [24, 8, 0]),
         "hf": (dict(random_seed=7, sequence_length=64, blend=([PREFIX], None),
                     split="90,8,2"), [100, 20, 5]),
         "null_mock": (dict(random_seed=7, sequence_length=64), [100, 20, 5])}


@pytest.fixture(scope="module")
def workdir(shared_data, tmp_path_factory):
    """A directory laid out as the generator's: the corpus (the same 200 random documents)
    and the tokenizer files under the relative names the descriptions record."""
    root = tmp_path_factory.mktemp("descriptions")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(root / f"{PREFIX}.bin", dtype=np.int32)
    for _ in range(200):
        n = int(rng.integers(20, 200))
        builder.add_document(rng.integers(0, 4000, n).astype(np.int32), [n])
    builder.finalize(root / f"{PREFIX}.idx")
    tokenizers = shared_data / "tokenizers"
    shutil.copy(tokenizers / "gpt2-vocab.json", root / VOCAB)
    shutil.copy(tokenizers / "gpt2-merges.txt", root / MERGES)
    return root


def _tokenizer(case: str, root: Path):
    if case == "gpt2bpe":
        from megatron.tokenizer.gpt2 import GPT2BPETokenizer
        return GPT2BPETokenizer(VOCAB, MERGES)
    if case == "hf":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        from megatron.tokenizer.huggingface import HuggingFaceTokenizer
        hf = Tokenizer(models.BPE.from_file(str(root / VOCAB), str(root / MERGES)))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        (root / HF_DIR).mkdir(exist_ok=True)
        hf.save(str(root / HF_DIR / "tokenizer.json"))
        return HuggingFaceTokenizer(HF_DIR)
    from megatron.tokenizer.null import NullTokenizer
    return NullTokenizer(4096)


@pytest.mark.parametrize("case", list(CASES))
def test_descriptions_and_cache_names_equal_megatron_cores(workdir, monkeypatch, case):
    monkeypatch.chdir(workdir)  # the relative paths resolve here, as in the generator's run
    fields, sizes = CASES[case]
    config = GPTDatasetConfig(tokenizer=_tokenizer(case, workdir), path_to_cache=f"cache_{case}",
                              **fields)
    built = [d for d in build_train_valid_test_datasets(config, sizes) if d is not None]
    expected = REFERENCE[case]
    assert sorted(d.index_split.name for d in built) == sorted(expected)
    for dataset in built:
        reference = expected[dataset.index_split.name]
        assert dataset.unique_description == reference["description"], dataset.index_split
        assert dataset.unique_description_hash == reference["md5"] == hashlib.md5(
            reference["description"].encode("utf-8")).hexdigest()
        if case != "null_mock":  # mock indices are not cached here (cheap to rebuild)
            name = (f"{reference['md5']}-GPTDataset-{dataset.index_split.name}"
                    "-description.txt")
            written = workdir / f"cache_{case}" / name
            assert written.read_bytes() == reference["description"].encode("utf-8")
