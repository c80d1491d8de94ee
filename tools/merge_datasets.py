"""Concatenate every dataset (``X.bin`` + ``X.idx``) of a directory into one, in sorted order.

    python tools/merge_datasets.py --input DIR --output-prefix OUT

Megatron-LM's tool, with its flags; the output is written under temporary names and renamed
once complete.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDataset, IndexedDatasetBuilder, data_file_path, index_file_path)


def dataset_prefixes(directory: str) -> list[str]:
    """Sorted prefixes of the ``.bin``/``.idx`` pairs in ``directory``.

    Raises:
        ValueError: a ``.bin`` without its ``.idx`` or the reverse, or no dataset at all.
    """
    if not os.path.isdir(directory):
        raise ValueError(f"--input {directory} is not a directory")
    stems = {}
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            stems.setdefault(stem, set()).add(ext)
    for stem, exts in stems.items():
        if exts != {".bin", ".idx"}:
            missing = ({".bin", ".idx"} - exts).pop()
            raise ValueError(f"{os.path.join(directory, stem)}: {missing} file not provided")
    if not stems:
        raise ValueError(f"--input {directory}: no .bin/.idx datasets in it")
    return [os.path.join(directory, stem) for stem in sorted(stems)]


def merge(prefixes: list[str], output_prefix: str, multimodal: bool = False) -> None:
    """Write ``output_prefix`` = the datasets of ``prefixes`` one after the other.

    Raises:
        ValueError: the datasets have different token dtypes.
    """
    dtype = IndexedDataset(prefixes[0], multimodal=multimodal).dtype
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    try:
        builder = IndexedDatasetBuilder(data_file_path(tmp), dtype=dtype, multimodal=multimodal)
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(tmp))
        os.replace(data_file_path(tmp), data_file_path(output_prefix))
        os.replace(index_file_path(tmp), index_file_path(output_prefix))
    finally:
        for path in (data_file_path(tmp), index_file_path(tmp)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--input", required=True,
                        help="directory holding the .bin/.idx pairs to merge (in sorted order)")
    parser.add_argument("--output-prefix", required=True,
                        help="path prefix of the merged dataset, without .bin/.idx")
    parser.add_argument("--multimodal", action="store_true",
                        help="the datasets carry per-sequence modes")
    args = parser.parse_args(argv)
    try:
        prefixes = dataset_prefixes(args.input)
        merge(prefixes, args.output_prefix, args.multimodal)
    except ValueError as err:
        print(f"merge_datasets.py: error: {err}", file=sys.stderr)
        return 1
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
