"""A plain PyTorch GPT-2 (nanoGPT style) used as the baseline of ``bench_train.py``.

Pre-LN blocks, learned position embeddings, biases, tanh GeLU (GPT-2's), SDPA causal attention,
output layer tied to the token embedding; ``torch.optim.AdamW(fused=True)``. Nothing here depends
on ``megatron``. Legend: b batch, s sequence, h hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int
    vocab_size: int = 50304


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)  # 3 x [b, s, h]
        q, k, v = (t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)
                   for t in (q, k, v))  # [b, nh, s, hn]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.c_fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.c_proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer [b, s, V]
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def configure_adamw(model: nn.Module, lr: float = 1e-4,
                    weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """AdamW with no decay on biases and norms, fused (6x faster than the default on CPU)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor,
               targets: torch.Tensor, bf16_autocast: bool) -> float:
    """One forward + backward + AdamW step; returns the loss."""
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
        loss = model(idx, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
