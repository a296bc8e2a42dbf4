"""pytorch_gpt3.py: the GPT-3 175B shard in plain PyTorch, the model and its mixed-precision training
step, that `pytorch_baseline.py gpt3` times against replay-gpt3. Shapes come from
pytorch_baseline.load_shard_config (what replay-gpt3 --print-config prints); this module imports torch,
pytorch_baseline.py imports it only to run.

One GPU's slice of the tensor-parallel layout: each layer holds this rank's attention heads and FFN
columns (column-parallel QKV and FC1, row-parallel projection and FC2) and the embedding holds this
rank's rows of the vocabulary. The all-reduces that would follow the row-parallel layers are not run.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pytorch_baseline import schedule_constants


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + proj(attention(ln1(x))), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, hidden, heads, head_dim, ffn):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        B, T, _ = x.shape
        # [B, T, 3 * H * D] -> q, k, v each [B, H, T, D]
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # dropout 0, as in MLPerf
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x


class GPT3Shard(nn.Module):
    """Token embedding (this rank's vocabulary rows, tied with the LM head), learned positions, the
    layers, a final LayerNorm, and the loss."""

    def __init__(self, cfg, layers):
        super().__init__()
        h = cfg["hidden"]
        self.wte = nn.Embedding(cfg["vocab_shard"], h)
        self.wpe = nn.Embedding(cfg["seq"], h)
        self.blocks = nn.ModuleList(Block(h, cfg["heads"], cfg["head_dim"], cfg["ffn"]) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        # GPT-2/3 initialisation: N(0, 0.02), the projections that feed the residual stream scaled by
        # 1/sqrt(2 * layers), biases zero, LayerNorms one and zero (their default).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for residual in (block.proj, block.fc2):
                nn.init.normal_(residual.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets):
        """Mean cross-entropy of `targets` given `idx`, both [B, T] ids already mapped into this rank's
        vocabulary shard (id mod vocab_shard).

        Megatron's vocab-parallel embedding and cross-entropy mask the ids outside the rank's range and
        all-reduce partial results (the embedding rows; the logits' max, the target logit and the sum of
        exponentials) over the TP ranks. With one process and no collectives, mapping the ids into the
        shard keeps the same arithmetic shape as replay's vocab-parallel loss: a lookup into the shard's
        rows, logits over the shard only, a softmax cross-entropy over those logits."""
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head: [B, T, vocab_shard]
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class MixedPrecisionTrainer:
    """bf16 model, fp32 master weights and gradients, fused AdamW on the masters; shared by the GPT-3 and
    Llama 3.1 baselines (any model whose forward(idx, targets) returns the mean loss).

    Everything that changes between steps (learning rate, step counter, optimizer step) lives on the
    device and nothing reads a device value on the host, so `step` can run eagerly or be captured whole,
    optimizer included, in one torch.cuda.graph.

    `opt` is pytorch_baseline.training_config's: replay's printed optimizer settings and warmup_cosine
    schedule. Each step sets the learning rate from the device step counter as replay does
    (learning_rate), so step s trains at pytorch_baseline.lr_at(s, opt) exactly.

    Memory: autograd makes a bf16 gradient for each bf16 parameter; a post-accumulate-grad hook copies it
    into the parameter's fp32 master gradient and frees it at once, so the step holds 18 bytes per
    parameter (fp32 master, bf16 parameter, fp32 gradient, Adam m and v) plus one bf16 gradient at a time.
    With several micro-batches per step the first micro-batch's backward copies, the later ones add (fp32
    accumulation, in a fixed order).
    """

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.params = list(model.parameters())
        self.accumulate = False  # the hooks add to the master gradients instead of overwriting them
        self.masters = [p.detach().float() for p in self.params]
        for param, master in zip(self.params, self.masters):
            master.grad = torch.zeros_like(master)
            param.register_post_accumulate_grad_hook(self._grad_to_master(master, self))
        device = self.params[0].device
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.step_count = torch.zeros((), dtype=torch.float64, device=device)  # steps taken, exact to 2^53
        # The schedule: lr and min_lr as replay's float32 settings (Python floats, exact in fp64); W and
        # T - W as device tensors, since torch divides a CUDA tensor by a host scalar as a multiplication
        # by its reciprocal, which can differ from the division in the last bit.
        self.base_lr, self.min_lr, self.warmup_steps, self.decay_steps = schedule_constants(opt)
        self.warmup_divisor = torch.tensor(float(self.warmup_steps), dtype=torch.float64, device=device)
        self.decay_divisor = torch.tensor(float(self.decay_steps - self.warmup_steps), dtype=torch.float64,
                                          device=device)
        # Weight decay on the matrices only (not biases or LayerNorm parameters), as in Megatron.
        groups = [{"params": [m for m in self.masters if m.dim() >= 2], "weight_decay": opt["weight_decay"]},
                  {"params": [m for m in self.masters if m.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=opt["betas"], eps=opt["eps"],
                                           fused=True, capturable=True)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr  # the one device tensor the schedule writes

    @staticmethod
    def _grad_to_master(master, trainer):
        def hook(param):
            if trainer.accumulate:
                master.grad.add_(param.grad)
            else:
                master.grad.copy_(param.grad)
            param.grad = None
        return hook

    def learning_rate(self):
        """pytorch_baseline.lr_at of the step counter s, on the device and in the same operations as
        replay's lr_at (train/schedule.h): fp64 throughout, rounded to float32 once. s < W: lr (s + 1) / W;
        W <= s < T: min_lr + ((lr - min_lr) 0.5) (1 + cos(pi (s - W) / (T - W))); s >= T: min_lr. Both
        branches are computed (no host branch on a device value); p is clamped so neither is NaN."""
        base, lo, w, t = self.base_lr, self.min_lr, self.warmup_steps, self.decay_steps
        s = self.step_count
        warmup = base * (s + 1) / self.warmup_divisor
        p = ((s - w) / self.decay_divisor).clamp(0.0, 1.0)
        cosine = lo + (base - lo) * 0.5 * (1.0 + torch.cos(math.pi * p))
        lr = torch.where(s < w, warmup, torch.where(s < t, cosine, torch.full_like(s, lo)))
        return lr.to(torch.float32)

    def clip_gradients(self):
        """Clips the master gradients to the global norm clip_norm; returns that norm (before
        clipping) as a device tensor. A tensor-parallel trainer sums the norm over its ranks."""
        return torch.nn.utils.clip_grad_norm_(self.masters, self.opt["clip_norm"], foreach=True)

    def step(self, tokens):
        """One training step on `tokens` [micro-batches, B, T + 1]: the gradient of the mean loss over the
        micro-batches; returns that mean loss and the gradient norm (before clipping) as device tensors."""
        n = tokens.size(0)
        loss = None
        for i in range(n):
            self.accumulate = i > 0
            mb_loss = self.model(tokens[i, :, :-1], tokens[i, :, 1:])
            (mb_loss / n if n > 1 else mb_loss).backward()
            loss = mb_loss.detach() if loss is None else loss + mb_loss.detach()
        self.accumulate = False
        if n > 1:
            loss = loss / n
        grad_norm = self.clip_gradients()
        self.lr.copy_(self.learning_rate())
        self.optimizer.step()
        self.step_count += 1
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)
        return loss, grad_norm
