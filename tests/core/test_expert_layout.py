"""The expert rank grid: Megatron's orthogonal rank groups (its docstring's worked example),
and the expert grid's groups for EP x ETP x PP layouts, its pipeline groups the dense grid's."""

from __future__ import annotations

import pytest

from megatron.core.expert_layout import expert_rank_layout, orthogonal_rank_groups
from megatron.core.parallel_state import rank_layout


def test_megatrons_worked_example():
    # parallel_size [tp, dp, pp] = [2, 3, 4], mask dp: dp_group[0] = [0, 2, 4] ...
    groups = orthogonal_rank_groups([2, 3, 4], [False, True, False])
    assert groups[0] == [0, 2, 4] and groups[1] == [1, 3, 5] and groups[7] == [19, 21, 23]
    assert len(groups) == 8


def test_expert_grid_ep2_etp1_pp2_on_8_ranks():
    layout = expert_rank_layout(8, 1, 2, 2)
    assert layout.expert_model == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.expert_data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.expert_tensor == [[r] for r in range(8)]
    # The same pipeline groups as the dense grid's (TP=2 x PP=2 here).
    assert layout.pipeline == rank_layout(8, 2, 2).pipeline


def test_expert_grid_etp2_ep2_folds_over_dense_tp():
    layout = expert_rank_layout(8, 2, 2, 1)
    assert layout.expert_tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.expert_model == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.expert_tensor_and_model == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.expert_data == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_sizes_that_do_not_divide_the_world_name_the_flags():
    with pytest.raises(ValueError, match="--expert-model-parallel-size"):
        expert_rank_layout(6, 1, 4, 1)
