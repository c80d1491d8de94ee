"""tools/checkpoint/optimizer_state.py without training: the parameter order it derives from a
checkpoint is the model's own ``named_parameters()`` order (which the torch optimizer's state
indices follow), and ``--keep-optimizer-state`` refuses what it cannot carry, naming the file
or flag. The end-to-end proof (resumed losses) is test_convert_training.py."""

from __future__ import annotations

import pytest

from megatron.checkpointing import flatten_model_state
from megatron.core.checkpoint_keys import HEAD_COPY_WEIGHT as HEAD_COPY
from megatron.core.models.bert import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_param_groups
from tests.tools.checkpoint import helpers
from tools.checkpoint import convert
from tools.checkpoint.optimizer_state import param_groups, parameter_order


def _checkpoint_name(name: str) -> str:
    return HEAD_COPY if name == "word_embeddings.weight" else name


@pytest.mark.parametrize("family", ["GPT", "BERT"])
@pytest.mark.parametrize("pre, post", [(True, True), (True, False), (False, True),
                                       (False, False)])
def test_parameter_order_and_groups_are_the_models(family, pre, post):
    if family == "GPT":
        model = GPTModel(helpers.config(num_layers=2), None, pre_process=pre, post_process=post)
    else:
        model = BertModel(helpers.config(num_layers=2, num_tokentypes=2), None,
                          pre_process=pre, post_process=post)
    flat = flatten_model_state(model.state_dict_for_save_checkpoint())
    names = {id(p): _checkpoint_name(n) for n, p in model.named_parameters()}
    assert parameter_order(list(flat)) == list(names.values())
    # The groups (and so the state indices) of megatron.core.optimizer.get_param_groups.
    expected = [[names[id(p)] for p in group["params"]]
                for group in get_param_groups([model], weight_decay=0.1)]
    assert [[key for _, key in members] for _, members in param_groups([flat])] == expected


def test_keep_optimizer_state_refuses_a_checkpoint_without_one(tmp_path, capsys):
    model = helpers.gpt(num_layers=2)
    path = helpers.save_single(tmp_path / "src", model, helpers.args_of(model))
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "out"), "--keep-optimizer-state"]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and "no optimizer state" in error and "--no-load-optim" in error
    assert convert.main(["--model-type", "GPT", "--load-dir", str(tmp_path / "src"),
                         "--save-dir", str(tmp_path / "hf"), "--saver", "hf",
                         "--keep-optimizer-state"]) == 2
    assert "--keep-optimizer-state needs --loader megatron --saver megatron" in \
        capsys.readouterr().err
