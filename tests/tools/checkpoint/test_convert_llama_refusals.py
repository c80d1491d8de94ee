"""Llama-style checkpoints (issue 27) that tools/checkpoint/convert.py cannot convert yet are
refused, naming the flag, rather than written wrong (HF export of RoPE/RMSNorm/SwiGLU/GQA; a
SwiGLU checkpoint re-split to another TP size)."""

from __future__ import annotations

import argparse

import pytest

from tools.checkpoint.convert import refuse_unconverted_architecture


class _Described:
    def __init__(self, **args):
        self.args = argparse.Namespace(**args)


def _opts(saver: str, tp: int = 1) -> argparse.Namespace:
    return argparse.Namespace(saver=saver, target_tensor_parallel_size=tp)


@pytest.mark.parametrize("args, flag", [
    ({"position_embedding_type": "rope"}, "--position-embedding-type rope"),
    ({"normalization": "RMSNorm"}, "--normalization RMSNorm"),
    ({"swiglu": True}, "--swiglu"),
    ({"group_query_attention": True, "num_query_groups": 2}, "--group-query-attention")])
def test_hf_export_refuses_llama_features(args, flag):
    with pytest.raises(ValueError, match=flag):
        refuse_unconverted_architecture(_Described(**args), _opts("hf"))


def test_swiglu_keeps_its_tp_size():
    md = _Described(swiglu=True, tensor_model_parallel_size=2)
    refuse_unconverted_architecture(md, _opts("megatron", tp=2))
    with pytest.raises(ValueError, match="--swiglu.*--target-tensor-parallel-size 2"):
        refuse_unconverted_architecture(md, _opts("megatron", tp=1))


def test_query_groups_split_over_the_target_tp():
    md = _Described(group_query_attention=True, num_query_groups=2,
                    tensor_model_parallel_size=2)
    refuse_unconverted_architecture(md, _opts("megatron", tp=1))  # whole groups concatenate
    with pytest.raises(ValueError, match="--num-query-groups 2"):
        refuse_unconverted_architecture(md, _opts("megatron", tp=4))


def test_gpt2_checkpoints_pass():
    refuse_unconverted_architecture(_Described(tensor_model_parallel_size=1), _opts("hf"))
