"""pytorch_llama31.py: the Llama 3.1 405B shard in plain PyTorch, the model that `pytorch_baseline.py
llama31` times against replay-llama31 (trained by pytorch_gpt3.MixedPrecisionTrainer). Shapes come from
pytorch_baseline.load_shard_config (what replay-llama31 --print-config prints); this module imports
torch, pytorch_baseline.py imports it only to run.

One GPU's slice of the tensor-parallel layout: each layer holds this rank's query and key/value heads and
FFN columns (column-parallel QKV and gate+up, row-parallel projection and FC2), the embedding and the
untied LM head hold this rank's rows of the vocabulary. The all-reduces that would follow the
row-parallel layers are not run.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pytorch_baseline import LLAMA31_NORM_EPS, rope_frequencies


def rope_tables(seq, head_dim):
    """cos and sin [seq, head_dim] fp32 for the rotate-half rotation, the angle pos * f_i repeated over
    both halves of the head; computed in fp64 and stored as fp32, as replay's rope_build_table."""
    f = torch.tensor(rope_frequencies(head_dim), dtype=torch.float64)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * f[None, :]
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE of x [B, T, H, D] with cos, sin [T, 1, D], in fp32, rounded to x's dtype once:
    out[i] = x[i] cos - x[i + D/2] sin, out[i + D/2] = x[i + D/2] cos + x[i] sin (replay's rope.h)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Block(nn.Module):
    """Pre-RMSNorm Llama layer: x + proj(attention(rope(qkv(norm1(x))))), then
    x + fc2(silu(gate) * up) with gate, up = fc1(norm2(x)); no biases."""

    def __init__(self, hidden, heads, kv_heads, head_dim, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = nn.RMSNorm(hidden, eps=LLAMA31_NORM_EPS)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=LLAMA31_NORM_EPS)
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)  # gate (columns [0, ffn)) and up, one GEMM
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        hq, hkv = self.heads, self.kv_heads
        # The fused QKV row [q heads | k heads | v heads]; RoPE rotates the q and k heads together (one
        # rotation over [B, T, hq + hkv, D], as replay's one launch), v stays a view of the QKV output.
        qkv = self.qkv(self.norm1(x)).view(B, T, hq + 2 * hkv, self.head_dim)
        qk = apply_rope(qkv[:, :, :hq + hkv], cos, sin)
        q, k, v = qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv:]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)  # dropout 0, as in MLPerf
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, hq * self.head_dim))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class Llama31Shard(nn.Module):
    """Token embedding (this rank's vocabulary rows), the layers, a final RMSNorm, the untied LM head
    (this rank's vocabulary rows) and the loss. No position table: RoPE inside the attention."""

    def __init__(self, cfg, layers):
        super().__init__()
        h = cfg["hidden"]
        self.embed = nn.Embedding(cfg["vocab_shard"], h)
        self.blocks = nn.ModuleList(Block(h, cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["ffn"])
                                    for _ in range(layers))
        self.norm_f = nn.RMSNorm(h, eps=LLAMA31_NORM_EPS)
        self.lm_head = nn.Linear(h, cfg["vocab_shard"], bias=False)
        # [T, 1, D], broadcast over the batch and the heads; plain attributes, not buffers, so that
        # Module.to(torch.bfloat16) leaves them fp32 (replay's table is fp32, the rotation's math fp32).
        cos, sin = rope_tables(cfg["seq"], cfg["head_dim"])
        self.rope_cos, self.rope_sin = cos[:, None, :], sin[:, None, :]
        # replay's initialisation (workloads/transformer/model.cpp): N(0, 0.02), the projections that feed
        # the residual stream scaled by 1/sqrt(2 * layers), the RMSNorm weights one (their default).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for block in self.blocks:
            for residual in (block.proj, block.fc2):
                nn.init.normal_(residual.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets):
        """Mean cross-entropy of `targets` given `idx`, both [B, T] ids already mapped into this rank's
        vocabulary shard (id mod vocab_shard), as pytorch_gpt3.GPT3Shard.forward explains."""
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm_f(x))  # [B, T, vocab_shard]
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
