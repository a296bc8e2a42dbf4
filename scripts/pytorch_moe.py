#!/usr/bin/env python3
"""pytorch_moe.py: replay-moe's DeepSeek-V3 shard in PyTorch: the whole training step (`train`) and
the routed experts' GEMMs alone (`gemms`, the default).

  python3 scripts/pytorch_moe.py train [--preset 671b-ep32] [--replay-bin DIR | --config FILE]
          [--layers N | --layers-from RUN_JSON] [--graphs none|full] [--steps 10] [--warmup 3]
          [--experts-gemm auto|grouped|loop] --json PATH
  python3 scripts/pytorch_moe.py [gemms] [--experts 8] [--tokens-per-expert 4096] [--hidden 7168]
          [--ffn 2048] [--reps 20] [--json PATH]
  (scripts/pytorch_baseline.py moe ... runs `train`.)

train: the blocks replay-moe runs, with the shapes, layer count and optimizer that replay prints
(`replay-moe --preset P --print-config`, or that document in --config FILE; --layers-from takes the
layer count a replay run JSON reports, since 671b-ep32 keeps as many blocks as fit the GPU). Per
block: RMSNorm (eps from the config; F.rms_norm where torch has it), MLA (q = rope(rmsnorm(h Wqa) Wqb), kv =
rmsnorm(h Wkva) Wkvb, one RoPE key h Wkpe shared by the heads, k = (k_nope, k_pe), v; RoPE on the
last qk_rope_head_dim channels, rotate-half, with YaRN when the config has it; causal
scaled_dot_product_attention at the config's softmax scale), the output projection plus the
residual; then a dense SwiGLU FFN, or the MoE: the fp32 router (sigmoid scores, group-limited top-k
on score + bias, weights from the scores normalised and scaled), MLPerf's sequence-level auxiliary
loss, the load and the bias update (bias += rate * sign(mean - load), in place, on the device), the
fold of global expert e onto local expert e mod local_experts (replay's one-process stand-in for
the all-to-all), the dispatch into a static capacity layout (ceil(F * tokens * topk / local) rows
per expert, the later assignments over capacity dropped, as replay), the routed experts through
torch._grouped_mm (or a loop over experts), the shared expert, and the weighted combine. The head is
replay's: a pipeline stage's loss sum(y * g) / n against a fixed next-stage gradient (671b-ep32,
tiny-ep), or an LM head with cross-entropy (tiny, small), plus the auxiliary losses. bf16 weights
with fp32 master weights, gradients and AdamW (pytorch_gpt3.MixedPrecisionTrainer) and replay's
schedule; eager (--graphs none) or the whole step in one torch.cuda.graph (--graphs full). Timed
with pytorch_baseline.timed_steps; writes one JSON document (reports/SCHEMA.md's workload keys).

What the whole-step graph needed: every shape static (the capacity layout; no dropless), no host
read anywhere (counts by scatter_add, not bincount, which reads the maximum on the host; no
.item()), the router bias and the YaRN tables as device buffers updated in place, AdamW with
capturable=True and the learning rate a device tensor, and warm-up steps on a side stream before the
capture (the optimizer's state and the allocator's pools exist by then).
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The keys of replay-moe's config this model reads (moe_workload.cpp MoeWorkload::config).
SHAPE_KEYS = ("micro_batch", "seq", "hidden", "heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "dense_layers", "moe_layers", "dense_ffn", "experts",
              "local_experts", "groups", "topk_groups", "topk", "expert_ffn", "shared_ffn")


class MoeConfigError(Exception):
    """A malformed or unsupported configuration: printed as one line, exit 2."""


# ---------------------------------------------------------------------------------------------------
# Configuration (no torch)
# ---------------------------------------------------------------------------------------------------

def yarn_mscale(factor, mscale):
    """DeepSeek-V3's yarn_get_mscale: 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(rope_dim, theta, yarn=None):
    """The rotation frequency of each of the rope_dim / 2 channel pairs, in fp64: theta^(-2i / rope_dim),
    or with YaRN (DeepSeek-V3's DeepseekV3YarnRotaryEmbedding): the interpolated frequency f / factor
    below the correction range, the original above it, a linear ramp between; the range from
    yarn_find_correction_range(beta_fast, beta_slow, rope_dim, theta, original_max_position)."""
    half = rope_dim // 2
    extra = [theta ** (-2.0 * i / rope_dim) for i in range(half)]
    if not yarn:
        return extra

    def correction_dim(rotations):
        return (rope_dim * math.log(yarn["original_max_position"] / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(half):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp  # 1: the original frequency (extrapolation), 0: interpolated
        out.append(extra[i] / yarn["factor"] * (1.0 - keep) + extra[i] * keep)
    return out


def rope_amplitude(yarn=None):
    """The factor on cos and sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)."""
    if not yarn:
        return 1.0
    return yarn_mscale(yarn["factor"], yarn["mscale"]) / yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])


def softmax_scale(qk_dim, yarn=None):
    """1 / sqrt(qk_dim), times yarn_mscale(factor, mscale_all_dim)^2 with YaRN (DeepSeek-V3's MLA)."""
    s = qk_dim ** -0.5
    if yarn and yarn.get("mscale_all_dim"):
        s *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    return s


def moe_config(doc, source="the configuration"):
    """The shard from a `replay-moe --print-config` document (or a replay-moe run JSON, which has the
    same `config`): the SHAPE_KEYS integers, the head ("lm" with vocab, or "pipeline_stage"), the
    router's scale, bias rate and auxiliary coefficient, the capacity factor, RoPE (theta, YaRN), the
    norm epsilon, and the optimizer and schedule (pytorch_baseline.training_config) when the document
    has `training`. Anything malformed is a MoeConfigError naming `source`."""
    def bad(what):
        raise MoeConfigError(f"{source}: {what}")

    if not isinstance(doc, dict) or doc.get("workload") != "moe":
        bad("not a replay-moe document (\"workload\" is not \"moe\")")
    c = doc.get("config")
    if not isinstance(c, dict):
        bad("no \"config\" object")
    cfg = {"preset": doc.get("preset")}
    for k in SHAPE_KEYS:
        v = c.get(k)
        lowest = 0 if k in ("dense_layers", "moe_layers") else 1
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= lowest):
            bad(f"config.{k} is {json.dumps(v) if k in c else 'missing'}, expected an integer >= {lowest}")
        cfg[k] = v
    if cfg["dense_layers"] + cfg["moe_layers"] < 1:
        bad("no block (dense_layers + moe_layers is 0)")
    if c.get("expert_parallel", 1) != 1:
        bad(f"config.expert_parallel is {c.get('expert_parallel')}: the baseline models one process")
    head = c.get("head")
    if head not in ("lm", "pipeline_stage"):
        bad(f"config.head is {json.dumps(head)}, expected \"lm\" or \"pipeline_stage\"")
    cfg["head"] = head
    cfg["vocab"] = c.get("vocab", 0)
    if head == "lm" and not (isinstance(cfg["vocab"], int) and cfg["vocab"] >= 8):
        bad(f"config.vocab is {json.dumps(cfg['vocab'])} with an LM head")
    for k, default in (("route_scale", None), ("bias_update_rate", None), ("aux_loss_coeff", None),
                       ("capacity_factor", None), ("norm_eps", 1e-6)):
        v = c.get(k, default)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            bad(f"config.{k} is {json.dumps(v) if k in c else 'missing'}, expected a number >= 0")
        cfg[k] = float(v)
    if c.get("dispatch", "capacity") != "capacity" or cfg["capacity_factor"] <= 0:
        bad("dropless dispatch: the baseline runs the static capacity layout only (give replay-moe "
            "--capacity-factor)")
    if cfg["experts"] % cfg["local_experts"] or cfg["experts"] % cfg["groups"]:
        bad("the local experts and the groups must divide the experts")
    rope = c.get("rope", {})
    if not isinstance(rope, dict):
        bad("config.rope is not an object")
    cfg["rope_theta"] = float(rope.get("theta", 10000.0))
    yarn = rope.get("yarn")
    if yarn is not None:
        keys = ("factor", "original_max_position", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        if not isinstance(yarn, dict) or any(not isinstance(yarn.get(k), (int, float)) for k in keys):
            bad(f"config.rope.yarn needs the numbers {', '.join(keys)}")
        yarn = {k: float(yarn[k]) for k in keys}
    cfg["yarn"] = yarn
    cfg["layers"] = cfg["dense_layers"] + cfg["moe_layers"]
    cfg["tokens"] = cfg["micro_batch"] * cfg["seq"]
    cfg["capacity"] = capacity_rows(cfg)
    if isinstance(doc.get("training"), dict):
        from pytorch_baseline import BaselineError, training_config
        try:
            cfg["optimizer"] = training_config(doc, source)
        except BaselineError as e:
            raise MoeConfigError(str(e)) from None
    return cfg


def capacity_rows(cfg):
    """Rows per local expert, as MoeShape::capacity: ceil(F * tokens * topk / local - 1e-9), at least 1,
    at most what one local expert can receive (tokens * min(topk, experts / local))."""
    tokens, topk, local = cfg["tokens"], cfg["topk"], cfg["local_experts"]
    exact = cfg["capacity_factor"] * tokens * topk / local
    most = tokens * min(topk, cfg["experts"] // local)
    return min(max(math.ceil(exact - 1e-9), 1), most)


def with_layers(cfg, dense, moe):
    """cfg with dense_layers / moe_layers set (the model keeps the first dense blocks, then MoE)."""
    out = dict(cfg, dense_layers=dense, moe_layers=moe, layers=dense + moe)
    return out


def attention_params(cfg):
    C, H = cfg["hidden"], cfg["heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return (C * cfg["q_lora_rank"] + cfg["q_lora_rank"] * H * qk + C * cfg["kv_lora_rank"]
            + C * cfg["qk_rope_head_dim"] + cfg["kv_lora_rank"] * H * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
            + H * cfg["v_head_dim"] * C)


def flops_per_step(cfg):
    """MoeModel::flops_per_step: 3 tokens (2 x active matrix parameters per token + the causal
    attention's layers S heads (d_qk + d_v)), NVIDIA's DeepSeek-V3 count."""
    C, H, S = cfg["hidden"], cfg["heads"], cfg["seq"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    dense = 3.0 * C * cfg["dense_ffn"]
    moe = 3.0 * C * cfg["shared_ffn"] + C * cfg["experts"] + cfg["topk"] * 3.0 * C * cfg["expert_ffn"]
    L = cfg["layers"]
    per_token = L * attention_params(cfg) + cfg["dense_layers"] * dense + cfg["moe_layers"] * moe
    if cfg["head"] == "lm":
        per_token += C * cfg["vocab"]
    attention = L * 2.0 * S * H * (qk + cfg["v_head_dim"]) / 2.0
    return 3.0 * cfg["tokens"] * (2.0 * per_token + attention)


def parameter_count(cfg):
    C = cfg["hidden"]
    per_block = attention_params(cfg) + 2 * C + cfg["q_lora_rank"] + cfg["kv_lora_rank"]
    dense = 3 * C * cfg["dense_ffn"]
    moe = (C * cfg["experts"] + 3 * cfg["local_experts"] * cfg["expert_ffn"] * C
           + 3 * cfg["shared_ffn"] * C)
    n = cfg["layers"] * per_block + cfg["dense_layers"] * dense + cfg["moe_layers"] * moe
    if cfg["head"] == "lm":
        n += 2 * cfg["vocab"] * C + C
    return n


# ---------------------------------------------------------------------------------------------------
# The model (torch)
# ---------------------------------------------------------------------------------------------------

def build_model_module():
    """Defines the torch modules (imported lazily so that the configuration half runs without torch)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, n, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            if hasattr(F, "rms_norm"):  # fused where torch has it; fp32 accumulation inside
                return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight.float()).to(x.dtype)

    def linear(n_in, n_out):
        return nn.Linear(n_in, n_out, bias=False)

    def rope(x, cos, sin):
        """Rotate-half RoPE on x [B, S, heads, R] with cos/sin [S, R / 2] (fp32), in fp32."""
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)

    def swiglu(a):
        g, u = a.chunk(2, dim=-1)
        return F.silu(g) * u

    class MLA(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            C, H = cfg["hidden"], cfg["heads"]
            self.H, self.dn, self.dr, self.dv = H, cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            eps = cfg["norm_eps"]
            self.q_a = linear(C, cfg["q_lora_rank"])
            self.q_a_norm = RMSNorm(cfg["q_lora_rank"], eps)
            self.q_b = linear(cfg["q_lora_rank"], H * (self.dn + self.dr))
            self.kv_a = linear(C, cfg["kv_lora_rank"])
            self.kv_a_norm = RMSNorm(cfg["kv_lora_rank"], eps)
            self.k_rope = linear(C, self.dr)
            self.kv_b = linear(cfg["kv_lora_rank"], H * (self.dn + self.dv))
            self.o = linear(H * self.dv, C)
            self.scale = softmax_scale(self.dn + self.dr, cfg["yarn"])
            self.pad_v = False  # set by ShardModel.choose_attention

        def forward(self, h, cos, sin):
            B, S, _ = h.shape
            H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
            q = self.q_b(self.q_a_norm(self.q_a(h))).view(B, S, H, dn + dr)
            q = torch.cat((q[..., :dn], rope(q[..., dn:], cos, sin)), -1)
            kv = self.kv_b(self.kv_a_norm(self.kv_a(h))).view(B, S, H, dn + dv)
            kpe = rope(self.k_rope(h).view(B, S, 1, dr), cos, sin)
            k = torch.cat((kv[..., :dn], kpe.expand(B, S, H, dr)), -1)
            v = kv[..., dn:]
            if self.pad_v:  # a backend that needs d_v == d_qk: pad v with zeros, drop them after
                v = F.pad(v, (0, dn + dr - dv))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, scale=self.scale)
            o = o.transpose(1, 2)[..., :dv].reshape(B, S, H * dv)
            return self.o(o)

    class DenseFFN(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.gate_up = linear(cfg["hidden"], 2 * cfg["dense_ffn"])
            self.down = linear(cfg["dense_ffn"], cfg["hidden"])

        def forward(self, h):
            return self.down(swiglu(self.gate_up(h)))

    def route(logits, bias, groups, topk_groups, topk, route_scale):
        """router_forward in fp32: indices [M, topk] by score + bias, group-limited (the topk_groups
        best groups by the sum of their two best biased scores), and the weights from the scores,
        normalised (+1e-20) and scaled. Returns (indices, weights, scores)."""
        M, E = logits.shape
        scores = torch.sigmoid(logits)
        biased = scores.detach() + bias
        if groups > 1:
            g = biased.view(M, groups, E // groups).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros(M, groups, dtype=torch.bool, device=logits.device)
            keep.scatter_(1, g.topk(topk_groups, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand(M, groups, E // groups).reshape(M, E)
            biased = biased.masked_fill(~keep, float("-inf"))
        idx = biased.topk(topk, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale
        return idx, w, scores

    def aux_loss(scores, idx, seq, coeff):
        """MLPerf's sequence-level auxiliary loss (router.h): coeff * mean_b sum_i f_bi P_bi."""
        M, E = scores.shape
        topk = idx.shape[1]
        nseq = M // seq
        q = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        P = q.view(nseq, seq, E).mean(1)
        with torch.no_grad():
            counts = torch.zeros(nseq, E, dtype=torch.float32, device=scores.device)
            counts.scatter_add_(1, idx.view(nseq, seq * topk),
                                torch.ones(nseq, seq * topk, dtype=torch.float32, device=scores.device))
            f = counts * (E / (topk * seq))
        return coeff * (f * P).sum(-1).mean()

    def dispatch_rows(local, L, cap):
        """The capacity layout of assignments a = t * topk + j to local experts `local` [M * topk]:
        dest [M * topk], the row of each assignment (L * cap, a zero row, when dropped: the later
        assignments in token order over the expert's capacity), row_token [L * cap], the token of
        each row (M for padding), and the dropped count. Stable sort by expert, no host read."""
        n = local.numel()
        dev = local.device
        order = torch.argsort(local, stable=True)
        counts = torch.zeros(L, dtype=torch.int64, device=dev).scatter_add_(
            0, local, torch.ones(n, dtype=torch.int64, device=dev))
        starts = torch.cumsum(counts, 0) - counts
        sorted_e = local[order]
        pos = torch.arange(n, device=dev) - starts[sorted_e]
        keep = pos < cap
        row_sorted = torch.where(keep, sorted_e * cap + pos, torch.full_like(pos, L * cap))
        dest = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)
        return dest, keep

    class MoE(nn.Module):
        def __init__(self, cfg, experts_gemm):
            super().__init__()
            C, L, Fe, Fs = cfg["hidden"], cfg["local_experts"], cfg["expert_ffn"], cfg["shared_ffn"]
            self.cfg, self.experts_gemm = cfg, experts_gemm
            self.router = linear(C, cfg["experts"])
            self.register_buffer("bias", torch.zeros(cfg["experts"], dtype=torch.float32))
            self.register_buffer("dropped", torch.zeros((), dtype=torch.int64))
            self.gate_up = nn.Parameter(torch.empty(L, 2 * Fe, C))  # [experts, out, in], as nn.Linear
            self.down = nn.Parameter(torch.empty(L, C, Fe))
            self.shared_gate_up = linear(C, 2 * Fs)
            self.shared_down = linear(Fs, C)
            cap = cfg["capacity"]
            self.register_buffer("offs", torch.arange(1, L + 1, dtype=torch.int32) * cap)

        def experts(self, x, w):
            """x [L * cap, in] in the capacity layout, w [L, out, in] -> [L * cap, out]."""
            L, cap = self.cfg["local_experts"], self.cfg["capacity"]
            if self.experts_gemm == "grouped":
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=self.offs)
            return torch.cat([x[e * cap:(e + 1) * cap] @ w[e].t() for e in range(L)])

        def forward(self, h2):
            """h2 [M, C] -> (routed + shared output [M, C], auxiliary loss)."""
            c = self.cfg
            M, C = h2.shape
            L, cap, topk = c["local_experts"], c["capacity"], c["topk"]
            logits = F.linear(h2.float(), self.router.weight.float())  # fp32 router
            idx, w, scores = route(logits, self.bias, c["groups"], c["topk_groups"], topk, c["route_scale"])
            aux = aux_loss(scores, idx, c["seq"], c["aux_loss_coeff"])
            with torch.no_grad():  # the load and the auxiliary-loss-free bias update, on the device
                E = c["experts"]
                load = torch.zeros(E, dtype=torch.int64, device=h2.device).scatter_add_(
                    0, idx.reshape(-1), torch.ones(M * topk, dtype=torch.int64, device=h2.device))
                self.bias.add_(torch.sign(load.sum() - E * load).float() * c["bias_update_rate"])
            local = idx.reshape(-1) % L  # replay's fold of the global experts onto the local ones
            dest, keep = dispatch_rows(local, L, cap)
            with torch.no_grad():
                self.dropped.copy_((~keep).sum())
                row_token = torch.full((L * cap + 1,), M, dtype=torch.int64, device=h2.device)
                row_token.scatter_(0, dest, torch.arange(M * topk, device=h2.device) // topk)
                row_token = row_token[:L * cap]
            h2z = torch.cat((h2, h2.new_zeros(1, C)))
            x_sorted = h2z[row_token]
            y_sorted = self.experts(swiglu(self.experts(x_sorted, self.gate_up)), self.down)
            y_tok = torch.cat((y_sorted, y_sorted.new_zeros(1, C)))[dest].view(M, topk, C)
            routed = torch.bmm(w.to(y_tok.dtype).unsqueeze(1), y_tok).squeeze(1)
            shared = self.shared_down(swiglu(self.shared_gate_up(h2)))
            return shared + routed, aux

    class Block(nn.Module):
        def __init__(self, cfg, moe, experts_gemm):
            super().__init__()
            self.attn_norm = RMSNorm(cfg["hidden"], cfg["norm_eps"])
            self.attn = MLA(cfg)
            self.ffn_norm = RMSNorm(cfg["hidden"], cfg["norm_eps"])
            self.ffn = MoE(cfg, experts_gemm) if moe else DenseFFN(cfg)
            self.moe = moe

        def forward(self, x, cos, sin):
            B, S, C = x.shape
            x = x + self.attn(self.attn_norm(x), cos, sin)
            h2 = self.ffn_norm(x).view(B * S, C)
            if self.moe:
                y, aux = self.ffn(h2)
            else:
                y, aux = self.ffn(h2), None
            return x + y.view(B, S, C), aux

    class ShardModel(nn.Module):
        """replay-moe's shard: blocks (dense first), then the head. forward(idx, targets) -> the loss
        (the head's plus the auxiliary losses); idx and targets are [B, S] token ids (LM head) or
        ignored (pipeline stage: the input and the next stage's gradient are fixed buffers)."""

        def __init__(self, cfg, experts_gemm):
            super().__init__()
            self.cfg = cfg
            C = cfg["hidden"]
            self.blocks = nn.ModuleList(Block(cfg, l >= cfg["dense_layers"], experts_gemm)
                                        for l in range(cfg["layers"]))
            if cfg["head"] == "lm":
                self.embedding = nn.Embedding(cfg["vocab"], C)
                self.final_norm = RMSNorm(C, cfg["norm_eps"])
                self.lm_head = linear(C, cfg["vocab"])
            freqs = torch.tensor(rope_frequencies(cfg["qk_rope_head_dim"], cfg["rope_theta"], cfg["yarn"]),
                                 dtype=torch.float64)
            angles = torch.arange(cfg["seq"], dtype=torch.float64)[:, None] * freqs[None, :]
            amp = rope_amplitude(cfg["yarn"])
            self.register_buffer("cos", (angles.cos() * amp).float())
            self.register_buffer("sin", (angles.sin() * amp).float())
            if cfg["head"] == "pipeline_stage":
                shape = (cfg["micro_batch"], cfg["seq"], C)
                self.register_buffer("stage_input", torch.randn(shape).to(torch.bfloat16))
                self.register_buffer("stage_grad", torch.randn(shape).to(torch.bfloat16))
            self.initialize()

        def initialize(self):
            """replay's initialisation: N(0, 0.02) matrices, the residual outputs (attention out, FFN
            and expert downs) N(0, 0.02 / sqrt(2 layers)), norms one."""
            out_std = 0.02 / math.sqrt(2.0 * self.cfg["layers"])
            for name, p in self.named_parameters():
                if p.dim() < 2:
                    continue
                residual = name.endswith(("attn.o.weight", "ffn.down.weight", "ffn.down",
                                          "ffn.shared_down.weight"))
                nn.init.normal_(p, 0.0, out_std if residual else 0.02)

        def forward(self, idx=None, targets=None):
            cfg = self.cfg
            if cfg["head"] == "lm":
                x = self.embedding(idx)
            else:
                x = self.stage_input
            aux_total = None
            for block in self.blocks:
                x, aux = block(x, self.cos, self.sin)
                if aux is not None:
                    aux_total = aux if aux_total is None else aux_total + aux
            if cfg["head"] == "lm":
                logits = self.lm_head(self.final_norm(x))
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
            else:
                loss = (x.float() * self.stage_grad.float()).sum() / x.numel()
            return loss if aux_total is None else loss + aux_total

        def dropped(self):
            """Per MoE block the assignments dropped at the capacity in the last step (device tensor)."""
            d = [b.ffn.dropped for b in self.blocks if b.moe]
            return torch.stack(d) if d else None

    return {"ShardModel": ShardModel, "route": route, "aux_loss": aux_loss, "dispatch_rows": dispatch_rows,
            "rope": rope, "RMSNorm": RMSNorm}


def make_model(cfg, experts_gemm, device, dtype=None):
    """ShardModel on `device`, its parameters in `dtype` (bf16 by default), its buffers as built
    (the router biases and RoPE tables fp32)."""
    import torch
    mods = build_model_module()
    with torch.device(device):
        model = mods["ShardModel"](cfg, experts_gemm)
    dtype = dtype or torch.bfloat16
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def choose_experts_gemm(requested):
    import torch
    if requested == "auto":
        return "grouped" if hasattr(torch, "_grouped_mm") else "loop"
    if requested == "grouped" and not hasattr(torch, "_grouped_mm"):
        raise MoeConfigError(f"--experts-gemm grouped: torch {torch.__version__} has no torch._grouped_mm")
    return requested


def choose_attention(model, cfg, mode="auto"):
    """The SDPA backend the default selection takes for the model's q, k, v ([B, H, S, d_qk], v
    d_v). Where only the math backend takes d_v != d_qk (mode auto), or always (mode pad), v is padded
    to d_qk (as DeepSeek's own code does for flash attention) and the choice is made again. Returns
    (backend name, padded)."""
    import torch
    from pytorch_baseline import _backend_name
    B, S, H = cfg["micro_batch"], cfg["seq"], cfg["heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q = torch.empty(B, H, S, qk, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.empty(B, H, S, cfg["v_head_dim"], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    name = _backend_name(q, q, v, False)
    padded = mode == "pad" or name in (None, "MATH")
    if padded:
        vp = torch.empty(B, H, S, qk, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        name = _backend_name(q, q, vp, False)
    for block in model.blocks:
        block.attn.pad_v = padded
    return name or "default", padded


# ---------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------

def load_config(args):
    from pytorch_baseline import BaselineError, default_replay_bin, read_config_file, run_print_config
    try:
        if args.config:
            doc, source = read_config_file(args.config), f"--config {args.config}"
        else:
            doc, source = run_print_config(args.replay_bin or default_replay_bin(), "moe", args.preset)
    except BaselineError as e:
        raise MoeConfigError(str(e)) from None
    cfg = moe_config(doc, source)
    if args.config and args.preset and cfg["preset"] != args.preset:
        raise MoeConfigError(f"--preset {args.preset}: {source} is preset {cfg['preset']}")
    if "optimizer" not in cfg:
        raise MoeConfigError(f"{source}: no \"training\" block (give what --print-config prints)")
    moe = cfg["moe_layers"]
    if args.layers_from:
        try:
            with open(args.layers_from) as f:
                run = json.load(f)
            moe = run["config"]["moe_layers"]
            dense = run["config"]["dense_layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MoeConfigError(f"--layers-from {args.layers_from}: no config.moe_layers ({e})") from None
        if dense != cfg["dense_layers"]:
            raise MoeConfigError(f"--layers-from {args.layers_from}: {dense} dense blocks, the preset has "
                                 f"{cfg['dense_layers']}")
    if args.layers is not None:
        moe = args.layers
    return with_layers(cfg, cfg["dense_layers"], moe)


def run_train(args, cfg):
    import torch
    from pytorch_baseline import (BaselineError, Timer, capture_step, environment, fmt_ms, loss_hash,
                                  lr_at, measure_gemm_peak, progress, require_cuda, step_stats,
                                  torch_settings, timed_steps, weights_hash)
    from pytorch_gpt3 import MixedPrecisionTrainer
    try:
        require_cuda()
    except BaselineError as e:
        raise MoeConfigError(str(e)) from None
    torch.manual_seed(args.seed)
    gemm = choose_experts_gemm(args.experts_gemm)
    env, settings = environment(), torch_settings()
    peak = measure_gemm_peak(Timer(5, 20))
    torch.cuda.empty_cache()
    model = make_model(cfg, gemm, "cuda")
    backend, padded = choose_attention(model, cfg, args.attention)
    progress(f"pytorch_moe {cfg['preset']}: torch {env['torch']}, {env['gpu']}; graphs {args.graphs}; "
             f"{cfg['dense_layers']} dense + {cfg['moe_layers']} MoE blocks, hidden {cfg['hidden']}, "
             f"{cfg['heads']} heads, {cfg['local_experts']} local experts x {cfg['capacity']} rows "
             f"({gemm}), {parameter_count(cfg) / 1e6:.1f}M parameters; attention {backend}"
             f"{' (v padded to d_qk)' if padded else ''}; bf16 GEMM peak {peak:.1f} TFLOP/s")
    opt = cfg["optimizer"]
    trainer = MixedPrecisionTrainer(model, opt)
    lm = cfg["head"] == "lm"
    n_batches = args.warmup + args.steps
    gen = torch.Generator().manual_seed(args.seed)
    if lm:
        tokens = torch.randint(0, cfg["vocab"], (n_batches, 1, cfg["micro_batch"], cfg["seq"] + 1),
                               generator=gen).pin_memory()
        static_tokens = torch.empty(tokens.shape[1:], dtype=tokens.dtype, device="cuda")
    else:
        tokens = None  # the stage's input and gradient are the model's buffers
        static_tokens = torch.zeros(1, 1, 2, dtype=torch.int64, device="cuda")

    def load(i):
        if lm:
            static_tokens.copy_(tokens[i], non_blocking=True)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    graph, static_loss, pool_bytes = None, None, None
    graphs_info = {"count": 0, "nodes": 0, "capture_ms": None, "instantiate_ms": None}
    if args.graphs == "full":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(args.warmup):
                load(i)
                trainer.step(static_tokens)
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph, (static_loss, _), graphs_info, pool_bytes = capture_step(trainer, static_tokens)
        except BaselineError as e:
            raise MoeConfigError(str(e)) from None
        progress(f"captured the step: {graphs_info['nodes']} nodes, capture {graphs_info['capture_ms']:.1f} "
                 f"ms, instantiate {fmt_ms(graphs_info['instantiate_ms'])} ms")
    else:
        for i in range(args.warmup):
            load(i)
            trainer.step(static_tokens)
    torch.cuda.synchronize()
    step_ms, host_us, losses = timed_steps(args.steps, args.warmup, load, graph, static_loss, trainer,
                                           static_tokens)
    taken = args.warmup + args.steps
    lr, count, expected = trainer.lr.item(), trainer.step_count.item(), lr_at(taken - 1, opt)
    if count != taken or lr != expected:
        raise MoeConfigError(f"device schedule disagrees with lr_at: {count:g} steps, lr {lr!r} "
                             f"(expected {taken}, {expected!r})")
    profile = profile_step(trainer, static_tokens, load, taken - 1) if args.profile else None
    dropped = model.dropped()
    stats = step_stats(step_ms)
    seconds = stats["median"] * 1e-3
    flops = flops_per_step(cfg)
    loss_list = losses.tolist()
    config = {k: cfg[k] for k in SHAPE_KEYS}
    config.update(layers=cfg["layers"], head=cfg["head"], vocab=cfg["vocab"], capacity_factor=cfg["capacity_factor"],
                  capacity_rows_per_expert=cfg["capacity"], route_scale=cfg["route_scale"],
                  bias_update_rate=cfg["bias_update_rate"], aux_loss_coeff=cfg["aux_loss_coeff"],
                  rope_theta=cfg["rope_theta"], yarn=cfg["yarn"],
                  softmax_scale=softmax_scale(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["yarn"]),
                  expert_gemm=("torch._grouped_mm over the capacity layout (static offsets)" if gemm == "grouped"
                               else "a loop over the local experts (torch has no _grouped_mm)"),
                  attention_v_padded=padded, parameters=parameter_count(cfg), seed=args.seed,
                  steps=args.steps, warmup=args.warmup, precision="bf16")
    return {
        "tool": "pytorch", "version": torch.__version__, "workload": "moe", "preset": cfg["preset"],
        "graphs": args.graphs, "environment": env, "settings": settings, "config": config,
        "optimizer": dict(opt, betas=list(opt["betas"])),
        "attention_backend": backend,
        "tensor_parallel_collectives": "not run (1 process): the fold of the global experts onto the "
                                       "local ones stands in for the expert-parallel all-to-all, as replay's",
        "step_ms": stats,
        "host_enqueue_us": {"median": sorted(host_us)[len(host_us) // 2], "p90": sorted(host_us)[int(0.9 * (len(host_us) - 1))]},
        "throughput": {"tokens_per_s": cfg["tokens"] / seconds, "samples_per_s": cfg["micro_batch"] / seconds},
        "model_tflops": flops / seconds / 1e12, "flops_per_step": flops,
        "flops_formula": "3 * tokens * (2 * active matrix params per token + layers * S * heads * (d_qk + "
                         "d_v)) (replay-moe's, NVIDIA's DeepSeek-V3 count)",
        "mfu": flops / seconds / 1e12 / peak if peak else None,
        "peaks": {"bf16_gemm_tflops": peak},
        "memory": {"peak_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved(),
                   "graph_extra_bytes": pool_bytes},
        "graphs_info": graphs_info,
        "losses": loss_list, "loss_hash": loss_hash(loss_list),
        # SHA-256 of every bf16 byte needs a host copy of the weights (13 s of the budget for the
        # 3.3 B parameters of 671b-ep32): only for small shards; the bit sums always.
        "weights_hash": weights_hash(trainer.params) if parameter_count(cfg) <= 5e7 else None,
        "weights_bit_sums": weight_bit_sums(trainer.params),
        "dropped_last_step": dropped.tolist() if dropped is not None else [],
        "router_bias_abs_mean": [float(b.ffn.bias.abs().mean()) for b in model.blocks if b.moe],
        "profile": profile,
    }


# Kernel-name patterns of the profile's categories, tried in this order (lower case).
PROFILE_CATEGORIES = (
    ("attention", ("fmha", "flash", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "grouped")),
    ("optimizer and clipping", ("adam", "multi_tensor", "foreach", "norm_kernel")),
    ("sort, gather, scatter, index", ("sort", "radix", "scatter", "gather", "index", "cub")),
)


def profile_step(trainer, static_tokens, load, batch):
    """One more eager step (on batch `batch` again) under torch.profiler: the device time by kernel category
    (PROFILE_CATEGORIES, the rest `elementwise and other`) and the 15 longest kernels, in ms. The
    step trains the model (it is a step like the others), after the timed ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    load(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.step(static_tokens)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    cats = {name: 0.0 for name, _ in PROFILE_CATEGORIES}
    cats["elementwise and other"] = 0.0
    for name, ms in kernels.items():
        low = name.lower()
        cat = next((c for c, pats in PROFILE_CATEGORIES if any(p in low for p in pats)), "elementwise and other")
        cats[cat] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"step": "one eager step after the timed ones (torch.profiler, CUDA kernels)",
            "total_ms": sum(kernels.values()), "by_category_ms": cats,
            "top_kernels_ms": [[n[:120], ms] for n, ms in top]}


def weight_bit_sums(params):
    """FNV-1a 64 (as 16 hex digits) over each parameter's sum of its bf16 bit patterns (int16, summed
    as int64 on the device): equal weights give equal sums, a cheap check between runs."""
    import torch
    sums = torch.stack([p.detach().view(torch.int16).sum(dtype=torch.int64) for p in params]).tolist()
    h = 0xCBF29CE484222325
    for v in sums:
        for byte in int(v).to_bytes(8, "little", signed=True):
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def cmd_train(args):
    import torch
    cfg = load_config(args)
    if args.graphs == "full" and args.warmup < 1:
        raise MoeConfigError("--graphs full needs --warmup 1 or more (the optimizer's state is made on its "
                             "first step, outside the capture)")
    out_dir = os.path.dirname(os.path.abspath(args.json))
    if not os.path.isdir(out_dir):
        raise MoeConfigError(f"--json {args.json}: directory {out_dir} does not exist")
    from pytorch_baseline import progress, write_json
    tries = [cfg["moe_layers"]]
    if args.fit and cfg["moe_layers"] > 1:
        tries += list(range(cfg["moe_layers"] - 1, 0, -1))
    doc, note = None, None
    for moe in tries:
        c = with_layers(cfg, cfg["dense_layers"], moe)
        why = None
        try:
            doc = run_train(args, c)
            break
        except torch.cuda.OutOfMemoryError as e:
            why = str(e).splitlines()[0][:160]
        # Out of the except clause, the traceback and the model its frames hold are gone: free them.
        note = f"{moe} MoE blocks ran out of GPU memory ({why})"
        progress(note + ("; trying one fewer" if moe != tries[-1] else ""))
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if doc is None:
        raise MoeConfigError(note or "no run")
    if note:
        doc["config"]["layers_note"] = note
    s = doc["step_ms"]
    progress(f"step {s['median']:.3f} ms median (p10 {s['p10']:.3f}, p90 {s['p90']:.3f}), "
             f"{doc['throughput']['tokens_per_s']:.0f} tokens/s, {doc['model_tflops']:.1f} TFLOP/s, MFU "
             f"{doc['mfu']:.3f}, peak memory {doc['memory']['peak_bytes'] / 2**30:.2f} GiB; loss "
             f"{doc['losses'][0]:.5f} -> {doc['losses'][-1]:.5f}, dropped {doc['dropped_last_step']}")
    write_json(args.json, doc)
    progress(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------
# gemms: the expert GEMMs alone
# ---------------------------------------------------------------------------------------------------

def cmd_gemms(a):
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"tool": "pytorch_moe", "error": f"PyTorch is not importable: {e}"}))
        return 77
    if not torch.cuda.is_available():
        print(json.dumps({"tool": "pytorch_moe", "error": "no CUDA device"}))
        return 77
    dev = torch.device("cuda")
    E, T, C, F = a.experts, a.tokens_per_expert, a.hidden, a.ffn
    grouped = hasattr(torch, "_grouped_mm")
    torch.manual_seed(0)
    w1 = torch.randn(E, 2 * F, C, device=dev, dtype=torch.bfloat16) * 0.02  # [E, out, in]
    w2 = torch.randn(E, C, F, device=dev, dtype=torch.bfloat16) * 0.02

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(a.reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / a.reps

    def expert_mm(x, w, counts):
        if grouped:
            offs = torch.cumsum(torch.tensor(counts, device=dev, dtype=torch.int32), 0,
                                dtype=torch.int32)
            return lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        splits = list(counts)
        return lambda: torch.cat([xi @ w[i].t() for i, xi in enumerate(torch.split(x, splits))])

    def case(counts):
        rows = sum(counts)
        x = torch.randn(rows, C, device=dev, dtype=torch.bfloat16)
        h = torch.randn(rows, F, device=dev, dtype=torch.bfloat16)
        up = timed(expert_mm(x, w1, counts))
        down = timed(expert_mm(h, w2, counts))
        up_flops, down_flops = 2.0 * rows * C * 2 * F, 2.0 * rows * F * C
        return {"counts": counts, "gate_up_ms": up, "gate_up_tflops": up_flops / up / 1e9,
                "down_ms": down, "down_tflops": down_flops / down / 1e9}

    even = [T] * E
    uneven = [1024 + (7168 * i) // max(E - 1, 1) for i in range(E)]
    scale = T * E / sum(uneven)
    uneven = [max(16, int(round(c * scale / 16)) * 16) for c in uneven]
    xd = torch.randn(T * E, C, device=dev, dtype=torch.bfloat16)
    wd = torch.randn(2 * F, C, device=dev, dtype=torch.bfloat16)
    dense = timed(lambda: xd @ wd.t())
    out = {"tool": "pytorch_moe", "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0),
           "method": "torch._grouped_mm" if grouped else "loop over experts",
           "experts": E, "hidden": C, "ffn": F,
           "even": case(even), "uneven": case(uneven),
           "dense_gate_up_ms": dense,
           "dense_gate_up_tflops": 2.0 * T * E * C * 2 * F / dense / 1e9}
    text = json.dumps(out)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


def add_gemm_flags(p):
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens-per-expert", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default="")


def build_train_parser():
    t = argparse.ArgumentParser(prog="pytorch_moe.py train",
                                description="train replay-moe's shard in PyTorch, eager or as one graph")
    t.add_argument("--preset", default=None, help="replay-moe's preset (default 671b-ep32; with --config, the file's)")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--replay-bin", metavar="DIR", default=None,
                     help="folder of replay's binaries (default $REPLAY_BUILD_DIR/bin, else build/release/bin)")
    src.add_argument("--config", metavar="FILE", default=None,
                     help="what `replay-moe --preset P --print-config` printed, instead of running it")
    t.add_argument("--layers", type=int, default=None, help="MoE blocks (default: the configuration's)")
    t.add_argument("--layers-from", metavar="RUN_JSON", default=None,
                   help="the MoE blocks of a replay-moe run's JSON (config.moe_layers: as many as fit)")
    t.add_argument("--fit", action="store_true",
                   help="on running out of GPU memory, try again with one MoE block fewer (the JSON says so)")
    t.add_argument("--graphs", choices=("none", "full"), default="none")
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--experts-gemm", choices=("auto", "grouped", "loop"), default="auto",
                   help="auto: torch._grouped_mm where this torch has it, else a loop over experts")
    t.add_argument("--profile", action="store_true",
                   help="after the timed steps, one more eager step under torch.profiler: device time by "
                        "kernel category and the longest kernels, in the JSON's `profile`")
    t.add_argument("--attention", choices=("auto", "pad"), default="auto",
                   help="auto: SDPA's default selection at d_qk 192, d_v 128 (v padded only if that is the "
                        "math backend); pad: v padded to d_qk, which flash attention takes")
    t.add_argument("--json", required=True)
    return t


def build_gemms_parser():
    g = argparse.ArgumentParser(prog="pytorch_moe.py [gemms]", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gemm_flags(g)
    return g


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["train"]:
            args = build_train_parser().parse_args(argv[1:])
            if args.preset is None and args.config is None:
                args.preset = "671b-ep32"
            if args.steps < 1 or args.warmup < 0 or (args.layers is not None and args.layers < 1):
                raise MoeConfigError("--steps must be >= 1, --warmup >= 0 and --layers >= 1")
            if args.profile and args.graphs != "none":
                raise MoeConfigError("--profile runs one more eager step: give --graphs none (beside a "
                                     "graph's memory pool an eager step may not fit)")
            return cmd_train(args)
        return cmd_gemms(build_gemms_parser().parse_args(argv[1:] if argv[:1] == ["gemms"] else argv))
    except MoeConfigError as e:
        print(f"pytorch_moe.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
