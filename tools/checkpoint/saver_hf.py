"""Saver plug-in: a model description -> a local HuggingFace model directory.

GPT -> ``GPT2LMHeadModel`` or, Llama-style (RoPE / RMSNorm / SwiGLU), ``LlamaForCausalLM``
(``Qwen2ForCausalLM`` with ``--add-qkv-bias``, ``Qwen3ForCausalLM`` with ``--qk-layernorm``,
``MistralForCausalLM`` for an imported Mistral or with ``--hf-architecture``: ``hf_llama``),
BERT -> ``MegatronBertForPreTraining`` or, trained post-LN, ``BertForPreTraining``
(``hf_bert``):
``config.json``, ``model.safetensors`` (or ``model-0000K-of-0000N.safetensors`` shards +
``model.safetensors.index.json`` past ``max_shard_bytes``, written as they fill: the saver holds
one shard), the tokenizer files (``vocab.json`` / ``merges.txt``; BERT ``vocab.txt``). The
padded vocabulary rows are dropped (``vocab_size`` = the true vocabulary) unless
``keep_padded_vocab``. The GeLU form is mapped to ``activation_function``
``gelu_new`` (Megatron's tanh form: --openai-gelu or the default bias-GeLU fusion) or ``gelu``.

``transformers`` is an optional dependency (``pip install .[hf]``), imported here only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from megatron.checkpointing import CheckpointError
from megatron.checkpointing.files import write_error
from tools.checkpoint.hf_files import optional_module
from tools.checkpoint.hf_mapping import (ATTENTION, GPT2_LAYER, GPT2_LAYER_TENSORS, GPT2_QKV,
                                         LAYER, check_gpt2_compatible, gelu_is_tanh, qkv_to_hf)
from tools.checkpoint.hf_bert import architecture_for, bert_config, bert_tensors
from tools.checkpoint.hf_llama import (for_every_reader, hf_architecture, is_llama_style,
                                       llama_config, llama_tensors, special_token_ids)
from tools.checkpoint.hf_moe import check_moe_exportable, moe_config, moe_tensors
from tools.checkpoint.model_description import OUTPUT_LAYER, WORD_EMBEDDINGS, ModelDescription

DEFAULT_MAX_SHARD_BYTES = 1 << 30
"""safetensors shard size: the HF saver holds one shard (and safetensors its bytes) at a time."""


class ShardWriter:
    """safetensors shards filled in order and written as each fills."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # temporary file name, its keys

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        save_file = optional_module("safetensors.torch", "--saver hf").save_file
        if not self.pending:
            return
        name = f"shard-{len(self.written):05d}.tmp"
        try:
            save_file(self.pending, str(self.out / name), metadata={"format": "pt"})
        except Exception as err:  # noqa: BLE001 - SafetensorError wraps the OS error in text
            (self.out / name).unlink(missing_ok=True)
            raise _write_error_of(err, self.out / name, self.pending_bytes) from None
        self.written.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename to HF's names; an index when there are several shards."""
        self.flush()
        if len(self.written) == 1:
            os.replace(self.out / self.written[0][0], self.out / "model.safetensors")
            return
        total, weight_map = len(self.written), {}
        for i, (tmp, keys) in enumerate(self.written, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            weight_map.update({k: final for k in keys})
        index = {"metadata": {}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_error_of(err: Exception, path: Path, needed: int) -> Exception:
    """safetensors' error (``SafetensorError: ... os error 28``) as the Megatron saver reports
    a failed write: the directory, the bytes needed, the free space and --save-dir."""
    if isinstance(err, OSError):
        return write_error(err, path, needed, flag="--save-dir")
    text = str(err)
    code = re.search(r"os error (\d+)|code: (\d+)", text)
    if code is None:
        return CheckpointError(f"could not write {path.name} in --save-dir {path.parent}: "
                               f"{type(err).__name__}: {text[:200]}")
    number = int(code.group(1) or code.group(2))
    return write_error(OSError(number, os.strerror(number)), path, needed, flag="--save-dir")


def _vocab_rows(md: ModelDescription, keep_padded_vocab: bool) -> int:
    if keep_padded_vocab or md.true_vocab_size is None:
        return md.padded_vocab_size
    return md.true_vocab_size


def true_vocab_size_from_args(md: ModelDescription) -> int | None:
    """The tokenizer's vocabulary size when its files are at hand (GPT-2 ``vocab.json``, BERT
    ``vocab.txt``, ``--tokenizer-model`` of Llama2Tokenizer / HuggingFaceTokenizer) or the args
    hold it (NullTokenizer's ``vocab_size``)."""
    args = md.args
    vocab_file = getattr(args, "vocab_file", None)
    kind = getattr(args, "tokenizer_type", None)
    if vocab_file and os.path.isfile(vocab_file):
        if kind == "GPT2BPETokenizer":
            with open(vocab_file, encoding="utf-8") as f:
                return len(json.load(f))
        if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
            with open(vocab_file, encoding="utf-8") as f:
                return sum(1 for _ in f)
    model = getattr(args, "tokenizer_model", None)
    if kind in ("Llama2Tokenizer", "HuggingFaceTokenizer") and model and os.path.exists(model):
        from megatron.tokenizer.build import create_tokenizer
        from megatron.tokenizer.config import TokenizerConfig
        return create_tokenizer(TokenizerConfig(tokenizer_type=kind,
                                                tokenizer_model=model)).vocab_size
    if kind == "NullTokenizer" and getattr(args, "vocab_size", None) is not None:
        return int(args.vocab_size) + 1
    return None


def gpt2_config(md: ModelDescription, vocab: int):
    """The ``GPT2Config`` of ``md``."""
    GPT2Config = optional_module("transformers", "--saver hf").GPT2Config
    args = md.args
    check_gpt2_compatible(args)
    dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(
        getattr(args, "params_dtype", torch.float32), "float32")
    eod = vocab - 1 if md.true_vocab_size is None else md.true_vocab_size - 1
    return GPT2Config(
        vocab_size=vocab, n_positions=int(args.max_position_embeddings),
        n_embd=int(args.hidden_size), n_layer=md.num_layers,
        n_head=int(args.num_attention_heads), n_inner=int(args.ffn_hidden_size),
        activation_function="gelu_new" if gelu_is_tanh(args) else "gelu",
        layer_norm_epsilon=float(getattr(args, "layernorm_epsilon", 1e-5)),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=not md.untied, bos_token_id=eod, eos_token_id=eod,
        architectures=["GPT2LMHeadModel"], torch_dtype=dtype)


def save(md: ModelDescription, save_dir: str | Path, *, keep_padded_vocab: bool = False,
         tokenizer_dir: str | Path | None = None,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, architecture: str | None = None) -> Path:
    """Write ``md`` as a HuggingFace model directory; returns it.

    Args:
        architecture: BERT: the HF class asked for (``--hf-architecture``); None: the one the
            checkpoint's layer arrangement needs.

    Raises:
        ValueError: a model the HF class cannot express (naming the flag).
    """
    if md.family == "BERT":
        architecture = architecture_for(md.args, architecture)  # before anything is written
    else:
        architecture = _gpt_architecture(md, architecture)  # before anything is written
    out = Path(save_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--save-dir {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    if md.true_vocab_size is None:
        md.true_vocab_size = true_vocab_size_from_args(md)
    vocab = _vocab_rows(md, keep_padded_vocab)
    if vocab > md.padded_vocab_size:
        raise ValueError(f"the tokenizer's vocabulary ({vocab}, from its files or "
                         f"--true-vocab-size) is larger than the checkpoint's "
                         f"{md.padded_vocab_size} word-embedding rows: pass the tokenizer the "
                         "checkpoint was trained with, or --true-vocab-size")
    if md.family == "BERT":
        return _save_bert(md, out, vocab, tokenizer_dir, max_shard_bytes, architecture)
    if getattr(md.args, "num_experts", None):
        return _save_moe(md, out, vocab, tokenizer_dir, max_shard_bytes, architecture)
    if is_llama_style(md.args):
        return _save_llama(md, out, vocab, tokenizer_dir, max_shard_bytes, architecture)
    config = gpt2_config(md, vocab)
    heads = int(md.args.num_attention_heads)
    writer = ShardWriter(out, max_shard_bytes)
    embeddings = md.embeddings()
    writer.add("transformer.wte.weight", embeddings[WORD_EMBEDDINGS][:vocab])
    writer.add("transformer.wpe.weight",
               embeddings["language_model.embedding.position_embeddings.weight"])
    del embeddings
    for i in range(md.num_layers):
        layer = md.layer(i)
        for ours, theirs, transposed in GPT2_LAYER_TENSORS:
            value = layer[LAYER.format(i) + ours]
            writer.add(GPT2_LAYER.format(i) + theirs, value.t() if transposed else value)
        for ours, theirs in GPT2_QKV:
            writer.add(GPT2_LAYER.format(i) + theirs,
                       qkv_to_hf(layer[ATTENTION.format(i) + ours.split(".", 1)[1]], heads))
        del layer
    head = md.head()
    writer.add("transformer.ln_f.weight", head["language_model.encoder.final_layernorm.weight"])
    writer.add("transformer.ln_f.bias", head["language_model.encoder.final_layernorm.bias"])
    if md.untied:
        writer.add("lm_head.weight", head[OUTPUT_LAYER][:vocab])
    writer.finish()
    config.save_pretrained(out)
    _copy_tokenizer(md, out, tokenizer_dir)
    return out


def _gpt_architecture(md: ModelDescription, requested: str | None) -> str:
    """The HF class of a GPT: ``requested`` where it holds the model (else ValueError)."""
    if getattr(md.args, "num_experts", None):
        needed = check_moe_exportable(md.args)
        if requested not in (None, needed):
            raise ValueError(f"--hf-architecture {requested}: this MoE GPT exports as {needed}")
        return needed
    if getattr(md.args, "qk_layernorm_full_projection", False):
        raise ValueError("--saver hf: --qk-layernorm-full-projection (q/k norms over all heads) "
                         "in a dense GPT: no Llama-family class holds it; keep it a Megatron "
                         "checkpoint")
    if is_llama_style(md.args):
        return hf_architecture(md.args, requested)
    if requested not in (None, "GPT2LMHeadModel"):
        raise ValueError(f"--hf-architecture {requested}: this GPT exports as GPT2LMHeadModel")
    return "GPT2LMHeadModel"


def _save_moe(md: ModelDescription, out: Path, vocab: int, tokenizer_dir,
              max_shard_bytes: int, architecture: str) -> Path:
    """MoE GPT -> ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``
    (``hf_moe``), the tokenizer as for Llama."""
    config = moe_config(md, vocab, architecture, _special_ids(md, vocab, tokenizer_dir))
    _write_model(out, config, moe_tensors(md, vocab, architecture), max_shard_bytes)
    path = out / "config.json"
    path.write_text(json.dumps(for_every_reader(json.loads(path.read_text()), md.args),
                               indent=2, sort_keys=True) + "\n")
    _copy_tokenizer(md, out, tokenizer_dir)
    return out


def _save_llama(md: ModelDescription, out: Path, vocab: int, tokenizer_dir,
                max_shard_bytes: int, architecture: str) -> Path:
    """Llama-style GPT -> ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``
    / ``Qwen3ForCausalLM`` (``hf_llama``)."""
    # Refuses what the class cannot hold, before anything is written.
    config = llama_config(md, vocab, architecture, _special_ids(md, vocab, tokenizer_dir))
    _write_model(out, config, llama_tensors(md, vocab), max_shard_bytes)
    path = out / "config.json"
    path.write_text(json.dumps(for_every_reader(json.loads(path.read_text()), md.args),
                               indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        _copy_tokenizer(md, out, tokenizer_dir)
        return out
    kind, model = getattr(md.args, "tokenizer_type", None), getattr(md.args, "tokenizer_model",
                                                                   None)
    if kind == "HuggingFaceTokenizer" and model and os.path.isdir(model):
        _copy_tokenizer(md, out, model)
    elif kind == "Llama2Tokenizer" and model and os.path.isfile(model):
        shutil.copyfile(model, out / "tokenizer.model")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "LlamaTokenizer"}, indent=2))
    else:
        _copy_tokenizer(md, out, None)  # a GPT-2 BPE tokenizer's files (examples/pretrain_llama.sh)
    return out


def _special_ids(md: ModelDescription, vocab: int,
                 tokenizer_dir) -> tuple[int | None, int | None]:
    """(bos, eos) of the tokenizer exported beside the model (``--tokenizer-dir``, else the
    checkpoint's HuggingFaceTokenizer / Llama2Tokenizer), where it names them; else the ids the
    import recorded (:func:`~tools.checkpoint.hf_llama.special_token_ids`)."""
    recorded = special_token_ids(md, vocab)
    tokenizer = _tokenizer_of(md, tokenizer_dir)
    if tokenizer is None:
        return recorded
    try:
        eos = tokenizer.eod
    except (ValueError, NotImplementedError, AttributeError):
        eos = None
    bos = getattr(tokenizer, "bos", None)
    return (recorded[0] if bos is None else bos), (recorded[1] if eos is None else eos)


def _tokenizer_of(md: ModelDescription, tokenizer_dir):
    """The tokenizer whose files go with the export, where it is one that names bos/eos."""
    from megatron.tokenizer.build import create_tokenizer
    from megatron.tokenizer.config import TokenizerConfig
    if tokenizer_dir is not None:
        if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
            return None
        kind, model = "HuggingFaceTokenizer", str(tokenizer_dir)
    else:
        kind, model = (getattr(md.args, name, None) for name in ("tokenizer_type",
                                                                   "tokenizer_model"))
        if kind not in ("HuggingFaceTokenizer", "Llama2Tokenizer") or not model or \
                not os.path.exists(model):
            return None
    try:
        return create_tokenizer(TokenizerConfig(tokenizer_type=kind, tokenizer_model=model))
    except ValueError:
        return None


def _write_model(out: Path, config, tensors, max_shard_bytes: int) -> None:
    """The ``(name, tensor)`` pairs in safetensors shards, then HF's ``config.json``."""
    writer = ShardWriter(out, max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.finish()
    config.save_pretrained(out)


def _save_bert(md: ModelDescription, out: Path, vocab: int, tokenizer_dir,
               max_shard_bytes: int, architecture: str) -> Path:
    """BERT -> ``MegatronBertForPreTraining`` / ``BertForPreTraining`` (``hf_bert``)."""
    config = bert_config(md, vocab, architecture)
    _write_model(out, config, bert_tensors(md, vocab, architecture), max_shard_bytes)
    if tokenizer_dir is not None:
        _copy_tokenizer(md, out, tokenizer_dir)
        return out
    vocab_file = getattr(md.args, "vocab_file", None)
    if vocab_file and os.path.isfile(vocab_file):
        shutil.copyfile(vocab_file, out / "vocab.txt")
        lower = getattr(md.args, "tokenizer_type", None) != "BertWordPieceCase"
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "BertTokenizer", "do_lower_case": lower}, indent=2))
    return out


def _copy_tokenizer(md: ModelDescription, out: Path, tokenizer_dir) -> None:
    """The tokenizer files: from ``tokenizer_dir``, else the checkpoint's GPT-2 BPE files."""
    if tokenizer_dir is not None:
        for entry in Path(tokenizer_dir).iterdir():
            if entry.is_file() and (entry.name.startswith("tokenizer") or entry.name in (
                    "vocab.json", "merges.txt", "vocab.txt", "special_tokens_map.json")):
                shutil.copyfile(entry, out / entry.name)
        return
    args = md.args
    if getattr(args, "tokenizer_type", None) != "GPT2BPETokenizer":
        return
    for flag, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        path = getattr(args, flag, None)
        if path and os.path.isfile(path):
            shutil.copyfile(path, out / name)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "model_max_length": int(
            md.args.max_position_embeddings), "bos_token": "<|endoftext|>",
         "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, indent=2))
