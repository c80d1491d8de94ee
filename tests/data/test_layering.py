"""The data layer's own seam: the builder, the base dataset and its config import no dataset
kind (GPT, BERT), so a new kind is an addition. (No upward import and no cycle anywhere in
megatron/: tests/test_layering.py.)"""

from __future__ import annotations

import pytest

from tests.test_layering import _modules, _imports

PACKAGE = "megatron.data"
BASES = (f"{PACKAGE}.megatron_dataset", f"{PACKAGE}.blended_dataset", f"{PACKAGE}.indexed_dataset")


@pytest.mark.parametrize("name", ["builder", "blended_dataset", "megatron_dataset",
                                  "dataset_config"])
def test_builder_and_bases_know_no_dataset_kind(name):
    modules = _modules()
    module = f"{PACKAGE}.{name}"
    kinds = sorted(m for m in _imports(module, modules[module], modules)
                   if m.startswith(f"{PACKAGE}.") and m.endswith("_dataset") and m not in BASES)
    assert not kinds, f"{name} imports {kinds}: the builder takes the dataset class it builds"
