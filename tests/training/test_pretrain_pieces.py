"""The pieces of pretrain() that finetuning and evaluation scripts reuse, called without it:
``initialize_megatron`` -> ``setup_model_and_optimizer`` (restoring ``--load``) ->
``build_data_iterators`` -> ``evaluate_and_print``.

A 2-rank (DP=2) run trains and saves through pretrain(); the pieces then restore exactly its
final weights and iteration, and evaluate them with Megatron's validation line.
"""

from __future__ import annotations

import math

import torch

from megatron.core import parallel_state
from tests.multiprocess import run_distributed
from tests.training import e2e

ITERS = 4


def _evaluate_with_pieces(rank: int, world_size: int, argv: list[str]) -> dict:
    import pretrain_gpt
    from megatron.training.initialize import build_tokenizer_from_config, initialize_megatron
    from megatron.training.loop import evaluate_and_print
    from megatron.training.pretrain import (build_data_iterators, build_microbatch_calculator,
                                            setup_model_and_optimizer)

    del rank, world_size
    parallel_state.destroy_model_parallel()
    cfg = initialize_megatron(argv)
    model, optimizer, scheduler, state = setup_model_and_optimizer(cfg,
                                                                   pretrain_gpt.model_provider)
    tokenizer = build_tokenizer_from_config(cfg)
    _, valid_it, _ = build_data_iterators(cfg, tokenizer, pretrain_gpt.datasets_provider,
                                          ITERS, state)
    losses = evaluate_and_print("pieces", pretrain_gpt.forward_step, valid_it, model, cfg,
                                build_microbatch_calculator(cfg), None, state, eval_iters=2)
    del scheduler
    return {"iteration": state.iteration, "losses": losses,
            # Adam's moments exist only after a step, or after loading them.
            "has_optimizer_state": bool(optimizer.state_dict()["state"]),
            "params": e2e._gather_full_params(model[0].module)}


def test_pieces_restore_and_evaluate_without_pretrain(gpt2_corpus, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train = e2e.gpt_argv(gpt2_corpus, iters=ITERS, extra=["--save", ckpt, "--save-interval",
                                                          str(ITERS)])
    [trained] = e2e.pooled(2, [{"argv": train, "params": True}])
    # A save killed mid-write left its temporary file: removed at the next start-up.
    stale = tmp_path / "ckpt" / "iter_0000004" / "mp_rank_00" / ".model_optim_rng.pt.tmp-4242"
    stale.write_bytes(b"\0" * 1024)
    pieces = run_distributed(2, _evaluate_with_pieces,
                             train + ["--load", ckpt, "--eval-iters", "2"], timeout=300)
    for rank, result in enumerate(pieces):
        assert result["iteration"] == ITERS
        assert result["has_optimizer_state"]
        reference = trained[rank]["params"]
        assert set(result["params"]) == set(reference)
        for name, value in result["params"].items():
            assert torch.equal(value, reference[name]), name
        assert math.isfinite(result["losses"]["lm loss"])
    assert not stale.exists()
    # Both data-parallel ranks report the same (DP-averaged) validation loss.
    assert pieces[0]["losses"] == pieces[1]["losses"]
