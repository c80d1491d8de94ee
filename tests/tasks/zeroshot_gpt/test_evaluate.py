"""Zero-shot evaluation end to end: tasks/main.py's perplexity equals a straightforward
computation written here (same windows, one model) at TP=1 (with DP=2), TP=2 and PP=2, and for a
Llama-style checkpoint at TP=2; LAMBADA's accuracy counts what the model predicts; strict and
non-strict LAMBADA differ where they should; a checkpoint of another vocabulary and a bad jsonl
line are refused before the model is built."""

from __future__ import annotations

import contextlib
import json
import math
import re

import pytest
import torch

from tasks.zeroshot_gpt import evaluate
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer
from tests.multiprocess import run_distributed

SEQ, STRIDE = 32, 12
MODEL = (f"--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length {SEQ} "
         f"--max-position-embeddings {SEQ} --micro-batch-size 3 --distributed-backend gloo "
         "--seed 11 --make-vocab-size-divisible-by 64").split()
# (64 x TP: GPT-2's 50257 pads to 50304 at TP=1 and 2 alike, so both are the same model; with
# Megatron's default 128, TP=2 pads to 50432 and its extra rows change the softmax.)
SCALE = 4.0  # weights further from init's N(0, 0.02): clearer argmax margins, a loss off ln V


def _gpt2_flags(shared: str) -> list[str]:
    return ["--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", f"{shared}/tokenizers/gpt2-vocab.json",
            "--merge-file", f"{shared}/tokenizers/gpt2-merges.txt"]


# ---------------------------------------------------------------------------------------------
# LAMBADA strict vs non-strict, on one process with a model whose predictions are set by hand.

class _BigramModel(torch.nn.Module):
    """Predicts ``table[token]`` after each token (logits one-hot); 0 elsewhere."""

    def __init__(self, table: dict[int, int], vocab: int) -> None:
        super().__init__()
        self.table, self.vocab = table, vocab

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        nxt = torch.tensor([[self.table.get(t, 0) for t in row] for row in tokens.tolist()])
        return torch.nn.functional.one_hot(nxt, self.vocab).float()   # [b, s, V]


def test_strict_lambada_needs_every_token_of_the_word(tmp_path, shared_data):
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.config import TokenizerConfig

    tok = build_tokenizer(TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(shared_data / "tokenizers" / "gpt2-vocab.json"),
        merge_file=str(shared_data / "tokenizers" / "gpt2-merges.txt")))
    ids = {piece: tok.tokenize(piece)[0] for piece in (" the", "str", "als", " of", " Qu")}
    ids["idd"], ids["itch"] = tok.tokenize(" Quidditch")[1:]
    # " thestrals" = " the" "str" "als": the model knows "als" follows "str" but not that
    # " the" follows " the"; " Quidditch" = " Qu" "idd" "itch": it knows the whole word.
    table = {ids["str"]: ids["als"], ids[" the"]: ids["str"], ids[" of"]: ids[" Qu"],
             ids[" Qu"]: ids["idd"], ids["idd"]: ids["itch"]}
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                            ("the old man fed the thestrals", "a game of Quidditch")))
    model = _BigramModel(table, tok.padded_vocab_size)
    found = {}
    for strict in (False, True):
        data = evaluate.LambadaData(str(path), tok, strict, 16)
        found[strict] = evaluate.evaluate(data, model, "accuracy", seq_length=16,
                                          micro_batch_size=3, dp_group=None, pp_group=None)
    assert found[False]["correct"] == 2 and found[False]["examples"] == 2
    assert found[True]["correct"] == 1 and found[True]["examples"] == 2
    assert found[True]["targets"] == 3 + 3 and found[False]["targets"] == 2


@pytest.mark.parametrize("stride,virtual,message", [
    (17, None, r"--overlapping-eval \(17\) must be between 1 and --seq-length \(16\)"),
    (0, None, r"--overlapping-eval \(0\) must be between 1"),
    (16, 2, "--num-layers-per-virtual-pipeline-stage .* is not supported"),
])
def test_flags_checked_once_validated(stride, virtual, message):
    from types import SimpleNamespace

    from tasks.flags import TaskFlags

    cfg = SimpleNamespace(data=SimpleNamespace(seq_length=16),
                          virtual_pipeline_model_parallel_size=virtual)
    with pytest.raises(ValueError, match=message):
        evaluate.check_run(cfg, TaskFlags(task="WIKITEXT103", overlapping_eval=stride))
    evaluate.check_run(SimpleNamespace(data=cfg.data, virtual_pipeline_model_parallel_size=None),
                       TaskFlags(task="WIKITEXT103", overlapping_eval=16))


# ---------------------------------------------------------------------------------------------
# Through the task on a world of two: TP=2, and TP=1 x DP=2.

def _scaled_model(cfg):
    from megatron.training.models import gpt_model_from

    model = gpt_model_from(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(SCALE)
    return model.eval()


def _save(argv: list[str], save: str):
    """Build the (TP-invariant) scaled model of ``argv`` and save it; returns (cfg, model)."""
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron

    cfg = initialize_megatron(argv + ["--save", save, "--save-interval", "1"])
    model = _scaled_model(cfg)
    save_checkpoint(1, [model], None, None, cfg, 0, 0)
    return cfg, model


def _save_pipeline_split(argv: list[str], save: str, full_state: dict) -> None:
    """This rank's pipeline stage of ``argv`` holding ``full_state``'s weights (stages are
    seeded apart, so the split is copied in rather than drawn), saved."""
    from megatron.checkpointing import GPT_LAYOUT
    from megatron.checkpointing.stages import PipelineStages
    from megatron.core import parallel_state
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.models import gpt_model_from

    cfg = initialize_megatron(argv + ["--save", save, "--save-interval", "1"])
    stages = PipelineStages(cfg.model.num_layers, cfg.parallel.pipeline_model_parallel_size)
    split = GPT_LAYOUT.split_pipeline(full_state, stages)
    model = gpt_model_from(cfg)
    model.load_state_dict(split[parallel_state.get_pipeline_model_parallel_rank()])
    save_checkpoint(1, [model], None, None, cfg, 0, 0)


def _reference_perplexity(model, tokenizer, path: str) -> dict:
    """One forward per window, scoring each target in the first window that holds it."""
    raw = open(path, encoding="utf-8").read()
    ids = tokenizer.tokenize(wikitext_detokenizer(raw))
    nll, next_target, begin = 0.0, 1, 0
    with torch.no_grad():
        while next_target < len(ids):
            window = ids[begin:begin + SEQ + 1]
            inputs = torch.tensor(window[:-1])[None]
            logits = model(inputs, torch.arange(len(window) - 1)[None], None)[0]
            logp = torch.log_softmax(logits.double(), -1)
            for j in range(len(window) - 1):
                if begin + j + 1 >= next_target:
                    nll -= logp[j, window[j + 1]].item()
            next_target, begin = begin + len(window), begin + STRIDE
    loss = nll / (len(ids) - 1)
    ratio = (len(ids) - 1) / (len(raw.strip().split(" ")) - 1)
    return {"avg_loss": loss, "ppl": math.exp(min(20, loss)),
            "adjusted_ppl": math.exp(min(20, loss * ratio)), "num_tokenized_tokens": len(ids)}


def _lambada_from_predictions(model, tokenizer, corpus: str, path: str) -> tuple[int, int]:
    """A LAMBADA file whose texts end with the model's argmax token (every third: with the
    corpus's next word instead), keeping texts whose tokens round-trip; returns (how many end
    with the argmax, how many texts)."""
    words = corpus.split()
    texts, expected = [], 0
    for k in range(24):
        context = tokenizer.tokenize(" ".join(words[k * 7:k * 7 + 6]))
        with torch.no_grad():
            logits = model(torch.tensor(context)[None], torch.arange(len(context))[None], None)
        best = int(logits[0, -1].argmax())  # over the padded vocabulary, as the task's argmax
        last = tokenizer.tokenize(" " + words[k * 7 + 6])[-1] if k % 3 == 0 else best
        if last >= tokenizer.vocab_size:
            continue  # a padding row: no text ends with it
        text = tokenizer.detokenize(context + [last])
        if tokenizer.tokenize(text) != context + [last]:
            continue
        texts.append(text)
        expected += last == best
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return expected, len(texts)


def _task(run, argv: list[str]):
    from megatron.core import parallel_state

    try:
        return run(argv)
    except SystemExit as err:
        return str(err)
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def _each_tokenizer_loaded_once():
    """Every run below builds the same GPT-2 tokenizer twice (validation and the run), about a
    second each: share one per configuration for the duration (padded sizes agree: see
    MODEL)."""
    import megatron.tokenizer
    from megatron.tokenizer import build

    original, loaded = build.create_tokenizer, {}

    def create_once(cfg):
        if repr(cfg) not in loaded:
            loaded[repr(cfg)] = original(cfg)
        return loaded[repr(cfg)]

    megatron.tokenizer.create_tokenizer = build.create_tokenizer = create_once
    try:
        yield
    finally:
        megatron.tokenizer.create_tokenizer = build.create_tokenizer = original


def _equivalence(rank: int, world_size: int, tmp: str, shared: str, wiki: str) -> dict:
    with _each_tokenizer_loaded_once():
        return _equivalence_runs(rank, tmp, shared, wiki)


def _equivalence_runs(rank: int, tmp: str, shared: str, wiki: str) -> dict:
    from megatron.core import comm, parallel_state
    from megatron.training.initialize import build_tokenizer_from_config

    tok_flags = _gpt2_flags(shared)
    cfg, model = _save(MODEL + tok_flags, f"{tmp}/tp1")
    tokenizer = build_tokenizer_from_config(cfg)
    out = {}
    lambada = f"{tmp}/lambada_test.jsonl"
    if rank == 0:
        out["reference"] = _reference_perplexity(model, tokenizer, wiki)
        corpus = open(f"{shared}/corpus/tinyshakespeare.txt", encoding="utf-8").read()[:20000]
        out["lambada_expected"] = _lambada_from_predictions(model, tokenizer, corpus, lambada)
    comm.barrier(comm.world_group())
    parallel_state.destroy_model_parallel()
    _save(MODEL + tok_flags + ["--tensor-model-parallel-size", "2"], f"{tmp}/tp2")
    parallel_state.destroy_model_parallel()
    _save_pipeline_split(MODEL + tok_flags + ["--pipeline-model-parallel-size", "2"],
                         f"{tmp}/pp2", model.state_dict())
    parallel_state.destroy_model_parallel()

    task = ["--valid-data", wiki, "--overlapping-eval", str(STRIDE), "--log-interval", "5"]
    lam = ["--valid-data", lambada, "--eval-micro-batch-size", "2"]
    tp2 = ["--load", f"{tmp}/tp2", "--use-checkpoint-args"]
    out["wiki_tp2"] = _task(evaluate.run_wikitext, tok_flags + tp2 + task)
    out["lambada_tp2"] = _task(evaluate.run_lambada, tok_flags + tp2 + lam)
    pp2 = ["--load", f"{tmp}/pp2", "--use-checkpoint-args"]
    out["wiki_pp2"] = _task(evaluate.run_wikitext, tok_flags + pp2 + task)
    out["lambada_pp2"] = _task(evaluate.run_lambada, tok_flags + pp2 + lam)
    out["wiki_tp1"] = _task(evaluate.run_wikitext, tok_flags + MODEL + task + [
        "--pretrained-checkpoint", f"{tmp}/tp1"])
    # Another vocabulary than the checkpoint's; a jsonl line without "text".
    null_tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    out["vocab"] = _task(evaluate.run_wikitext, MODEL + task + null_tokenizer + [
        "--load", f"{tmp}/tp1"])
    if rank == 0:
        with open(f"{tmp}/bad.jsonl", "w", encoding="utf-8") as bad:
            bad.write('{"text": "1 2 3"}\n{"body": "4 5 6"}\n')
    comm.barrier(comm.world_group())
    out["bad_line"] = _task(evaluate.run_lambada, MODEL + null_tokenizer + [
        "--random-weights", "--valid-data", f"{tmp}/bad.jsonl"])
    return out


@pytest.fixture()
def wiki_file(tmp_path, shared_data):
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:1500]
    word_level = " \n = Play = \n \n " + re.sub(r"([,.;:!?'])", r" \1", text).replace(
        "\n\n", " \n \n ").replace("\n", " \n ")
    path = tmp_path / "wiki.test.tokens"
    path.write_text(word_level + " \n")
    return path


def test_perplexity_and_accuracy_equal_the_reference_at_tp1_tp2_pp2(tmp_path, shared_data,
                                                                     wiki_file):
    results = run_distributed(2, _equivalence, str(tmp_path), str(shared_data), str(wiki_file))
    ref = results[0]["reference"]
    assert abs(ref["avg_loss"] - math.log(50257)) > 0.5  # scaled weights: far from uniform
    expected, total = results[0]["lambada_expected"]
    for rank in (0, 1):
        for name in ("tp1", "tp2", "pp2"):
            got = results[rank][f"wiki_{name}"]
            assert isinstance(got, dict), got
            assert got["num_tokenized_tokens"] == ref["num_tokenized_tokens"]
            for key in ("avg_loss", "ppl", "adjusted_ppl"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5), (name, key)
        for name in ("tp2", "pp2"):
            lam = results[rank][f"lambada_{name}"]
            assert isinstance(lam, dict), lam
            assert (lam["correct"], lam["total"]) == (expected, total), name
    assert 4 <= expected < total
    assert results[0]["vocab"].startswith(
        f"tasks/main.py: error: --load {tmp_path}/tp1: the checkpoint's vocabulary (50304 "
        "entries, padded; tokenizer GPT2BPETokenizer")
    assert "differs from this tokenizer's (1024 padded; --tokenizer-type NullTokenizer, " \
        "--vocab-size 1000): pass the tokenizer files" in results[0]["vocab"]
    assert results[1]["bad_line"] == (f"tasks/main.py: error: --valid-data {tmp_path}/bad.jsonl, "
                                      "line 2: no \"text\" string (each line must be a JSON "
                                      "object like {\"text\": \"...\"})")


# ---------------------------------------------------------------------------------------------
# A Llama-style checkpoint (RMSNorm, SwiGLU, RoPE with its own base, GQA, no biases, untied
# output layer) through both tasks at TP=2, its flags taken from the checkpoint: the perplexity
# equals the reference's over the saved TP=1 model, LAMBADA counts what that model predicts.

LLAMA = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
         f"--max-position-embeddings {SEQ} --micro-batch-size 3 --distributed-backend gloo "
         "--seed 11 --make-vocab-size-divisible-by 64 --normalization RMSNorm "
         "--norm-epsilon 1e-6 --swiglu --ffn-hidden-size 64 --position-embedding-type rope "
         "--rotary-base 1000 --group-query-attention --num-query-groups 2 "
         "--disable-bias-linear --untie-embeddings-and-output-weights").split()


def _llama_equivalence(rank: int, world_size: int, tmp: str, shared: str, wiki: str) -> dict:
    with _each_tokenizer_loaded_once():
        return _llama_runs(rank, tmp, shared, wiki)


def _llama_runs(rank: int, tmp: str, shared: str, wiki: str) -> dict:
    from megatron.core import comm, parallel_state
    from megatron.training.initialize import build_tokenizer_from_config

    tok_flags = _gpt2_flags(shared)
    cfg, model = _save(LLAMA + tok_flags, f"{tmp}/llama_tp1")
    out = {}
    lambada = f"{tmp}/lambada_test.jsonl"
    if rank == 0:
        tokenizer = build_tokenizer_from_config(cfg)
        out["reference"] = _reference_perplexity(model, tokenizer, wiki)
        corpus = open(f"{shared}/corpus/tinyshakespeare.txt", encoding="utf-8").read()[:20000]
        out["lambada_expected"] = _lambada_from_predictions(model, tokenizer, corpus, lambada)
    comm.barrier(comm.world_group())
    parallel_state.destroy_model_parallel()
    # The init is the same at any TP size: the TP=2 checkpoint holds the same scaled model.
    _save(LLAMA + tok_flags + ["--tensor-model-parallel-size", "2"], f"{tmp}/llama_tp2")
    parallel_state.destroy_model_parallel()

    # TP=2: each rank holds one key/value group and half the untied output layer's rows.
    load = ["--load", f"{tmp}/llama_tp2", "--use-checkpoint-args"]
    out["wiki"] = _task(evaluate.run_wikitext, tok_flags + load + [
        "--valid-data", wiki, "--overlapping-eval", str(STRIDE)])
    out["lambada"] = _task(evaluate.run_lambada, tok_flags + load + [
        "--valid-data", lambada, "--eval-micro-batch-size", "2"])
    return out


def test_llama_perplexity_and_accuracy_equal_the_reference(tmp_path, shared_data, wiki_file):
    results = run_distributed(2, _llama_equivalence, str(tmp_path), str(shared_data),
                              str(wiki_file))
    ref = results[0]["reference"]
    assert abs(ref["avg_loss"] - math.log(50257)) > 0.5  # scaled weights: far from uniform
    expected, total = results[0]["lambada_expected"]
    assert 4 <= expected < total
    for rank in (0, 1):
        got = results[rank]["wiki"]
        assert isinstance(got, dict), got
        assert got["num_tokenized_tokens"] == ref["num_tokenized_tokens"]
        for key in ("avg_loss", "ppl", "adjusted_ppl"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), key
        lam = results[rank]["lambada"]
        assert isinstance(lam, dict), lam
        assert (lam["correct"], lam["total"]) == (expected, total)


def test_windows_that_score_nothing_are_not_run():
    """Megatron's window count runs windows past the end of the text that score nothing; the
    evaluation drops them before any forward (the sums are unchanged: they add 0)."""
    from tasks.zeroshot_gpt import datasets
    totals: dict = {}
    windows = list(datasets.lm_windows([list(range(40))], 8, 2, pad=0, totals=totals))
    kept = list(evaluate.scoring(iter(windows)))
    # T = 40, seq 8, stride 2: Megatron's ceil((T - 1 - 2) / 2) + 1 = 20 windows; the last
    # scored target is token 39, in window ceil((T - 1 - seq) / stride) = 16.
    assert len(windows) == 20 and len(kept) == 17
    assert all(w.mask.any() for w in kept)
    assert sum(int(w.mask.sum()) for w in kept) == sum(int(w.mask.sum()) for w in windows) == 39
