#!/usr/bin/env python3
"""scripts/pytorch_moe.py's model of replay-moe's shard, on the CPU at tiny sizes (label cpu).

Without torch: the configuration from a replay-moe document (the build's `--print-config` where
REPLAY_BIN_DIR has replay-moe, else a written one), DeepSeek-V3's YaRN frequencies and softmax scale
(the values known in closed form), the capacity, and the FLOP count against replay's own JSON of the
671b-ep32 shard (reports/h100/2026-11-27/moe). With torch (CPU; the checks that need it are skipped,
saying so, where it is missing): the router against a per-token walk (group-limited selection on
score + bias, weights from the scores), the auxiliary loss against its formula, the capacity dispatch
against a walk over the assignments (stable order, the later ones dropped), the MoE layer against a
per-token sum over its kept experts, the expert GEMMs by torch._grouped_mm against the loop over
experts (where this torch's CPU build has _grouped_mm), RoPE's rotation (norm kept, relative
positions), causality of the whole shard, and a training step's bias update (+-rate against the
load) with finite gradients. Exit 0 when every check passes, 1 otherwise.
"""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import pytorch_moe as pm  # noqa: E402

FAILS = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILS.append(what)


def written_doc(preset="tiny-ep", yarn=False):
    """A replay-moe --print-config document at tiny-ep's sizes (what the binary prints)."""
    config = {"micro_batch": 2, "seq": 64, "hidden": 128, "vocab": 0, "head": "pipeline_stage", "heads": 2,
              "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "norm_eps": 1e-6,
              "rope": {"theta": 10000.0, "yarn": None}, "dense_layers": 0, "moe_layers": 2, "dense_ffn": 256,
              "experts": 32, "local_experts": 4, "expert_parallel": 1, "groups": 8, "topk_groups": 4,
              "topk": 4, "expert_ffn": 64, "shared_ffn": 64, "route_scale": 2.5,
              "bias_update_rate": 0.0010000000474974513, "aux_loss_coeff": 0.009999999776482582,
              "dispatch": "capacity", "capacity_factor": 1.0}
    if yarn:
        config["rope"]["yarn"] = {"factor": 40.0, "original_max_position": 4096.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    training = {"optimizer": {"name": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1,
                              "clip_norm": 1.0},
                "schedule": {"kind": "warmup_cosine", "lr": 0.003, "min_lr": 0.0003, "warmup_steps": 5,
                             "decay_steps": 300}}
    return {"tool": "replay-moe", "workload": "moe", "preset": preset, "config": config, "training": training}


def test_config():
    cfg = pm.moe_config(written_doc())
    check(cfg["capacity"] == 128 and cfg["tokens"] == 128 and cfg["layers"] == 2, "tiny-ep: 128 rows per expert")
    check(cfg["optimizer"]["betas"] == (0.9, 0.95), "the optimizer from `training`")
    for bad, why in ((dict(written_doc(), workload="gpt3"), "another workload"),):
        try:
            pm.moe_config(bad)
            check(False, f"refuses {why}")
        except pm.MoeConfigError:
            check(True, f"refuses {why}")
    doc = written_doc()
    doc["config"]["dispatch"] = "dropless"
    try:
        pm.moe_config(doc)
        check(False, "refuses dropless")
    except pm.MoeConfigError as e:
        check("capacity" in str(e), "refuses dropless, naming the capacity layout")
    # The build's own --print-config, when there is a build.
    bin_dir = os.environ.get("REPLAY_BIN_DIR", "")
    exe = os.path.join(bin_dir, "replay-moe")
    if bin_dir and os.access(exe, os.X_OK):
        for preset, yarn in (("671b-ep32", True), ("tiny", False), ("tiny-ep", False)):
            out = subprocess.run([exe, "--preset", preset, "--print-config"], capture_output=True, text=True)
            c = pm.moe_config(json.loads(out.stdout), preset)
            check((c["yarn"] is not None) == yarn, f"{preset}: YaRN {'on' if yarn else 'off'} as printed")
            if preset == "671b-ep32":
                check(c["capacity"] == 4096 and c["local_experts"] == 8 and c["experts"] == 256
                      and c["heads"] == 64, "671b-ep32: 64 heads, 8 of 256 experts, 4096 rows each")
    else:
        print("skip the build's --print-config: no replay-moe in REPLAY_BIN_DIR")


def test_yarn():
    y = {"factor": 40.0, "original_max_position": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
         "mscale_all_dim": 1.0}
    f = pm.rope_frequencies(64, 10000.0, y)
    plain = pm.rope_frequencies(64, 10000.0)
    check(all(abs(f[i] - plain[i]) <= 1e-15 * plain[i] for i in range(11)), "YaRN: pairs 0..10 keep theta^(-2i/64)")
    check(all(abs(f[i] - plain[i] / 40) <= 1e-15 * plain[i] for i in range(23, 32)),
          "YaRN: pairs 23..31 are divided by the factor 40")
    mid = [(i, plain[i] / 40 * (i - 10) / 13 + plain[i] * (1 - (i - 10) / 13)) for i in range(11, 23)]
    check(all(abs(f[i] - want) <= 1e-15 * plain[i] for i, want in mid), "YaRN: a linear ramp over pairs 10..23")
    m = 1 + 0.1 * math.log(40)
    check(abs(pm.softmax_scale(192, y) - m * m / math.sqrt(192)) < 1e-15, "YaRN: softmax scale 192^-0.5 mscale^2")
    check(pm.rope_amplitude(y) == 1.0 and pm.softmax_scale(192) == 192 ** -0.5, "no amplitude; plain scale")


def test_flops():
    path = os.path.join(ROOT, "reports", "h100", "2026-11-27", "moe", "671b-ep32_full.json")
    with open(path) as fh:
        doc = json.load(fh)
    cfg = pm.moe_config(doc, path)
    check(cfg["layers"] == 7, "replay's 671b-ep32 run: 7 blocks")
    ours, theirs = pm.flops_per_step(cfg), doc["flops_per_step"]
    check(abs(ours - theirs) <= 1e-12 * theirs, f"FLOPs per step as replay counts them ({ours:.6g} vs {theirs:.6g})")


def test_torch():
    try:
        import torch
    except ImportError:
        print("skip the model's checks: torch is not importable")
        return
    torch.manual_seed(0)
    mods = pm.build_model_module()
    route, aux_loss, dispatch_rows, rope = mods["route"], mods["aux_loss"], mods["dispatch_rows"], mods["rope"]

    # The router against a per-token walk.
    M, E, G, KG, K = 64, 32, 8, 4, 4
    logits = torch.randn(M, E, dtype=torch.float64)
    bias = torch.randn(E, dtype=torch.float64) * 0.05
    idx, w, scores = route(logits, bias, G, KG, K, 2.5)
    ok = True
    for t in range(M):
        s = [1 / (1 + math.exp(-float(v))) for v in logits[t]]
        b = [s[e] + float(bias[e]) for e in range(E)]
        gs = [sum(sorted(b[g * 4:(g + 1) * 4])[-2:]) for g in range(G)]
        kept = sorted(range(G), key=lambda g: -gs[g])[:KG]
        cands = [e for e in range(E) if e // 4 in kept]
        sel = sorted(cands, key=lambda e: -b[e])[:K]
        tot = sum(s[e] for e in sel) + 1e-20
        ok &= sorted(sel) == sorted(idx[t].tolist())
        ok &= all(abs(float(w[t, j]) - 2.5 * s[int(idx[t, j])] / tot) < 1e-12 for j in range(K))
    check(ok, "router: group-limited top-k on score + bias, weights from the scores")

    # The auxiliary loss against its formula (2 sequences of 32).
    a = aux_loss(scores, idx, 32, 0.01)
    want = 0.0
    for b_ in range(2):
        rows = range(b_ * 32, (b_ + 1) * 32)
        for e in range(E):
            cnt = sum(int((idx[t] == e).sum()) for t in rows)
            P = sum(float(scores[t, e] / scores[t].sum()) for t in rows) / 32
            want += E / (K * 32) * cnt * P
    want = 0.01 * want / 2
    check(abs(float(a) - want) < 1e-12, f"auxiliary loss {float(a):.6g} (formula {want:.6g})")

    # The capacity dispatch against a walk: assignments in token order, the first cap of each expert kept.
    L, cap = 4, 40
    local = idx.reshape(-1) % L
    dest, keep = dispatch_rows(local, L, cap)
    fill = [0] * L
    ok = True
    for a_ in range(M * K):
        e = int(local[a_])
        want_row = e * cap + fill[e] if fill[e] < cap else L * cap
        fill[e] += 1
        ok &= int(dest[a_]) == want_row
    check(ok and int((~keep).sum()) == sum(max(0, c - cap) for c in fill),
          f"dispatch: stable order, {sum(max(0, c - cap) for c in fill)} over-capacity assignments dropped")

    # RoPE keeps norms and makes scores depend on relative positions only.
    S, R = 16, 64
    fr = torch.tensor(pm.rope_frequencies(R, 10000.0), dtype=torch.float64)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * fr[None, :]
    cos, sin = ang.cos(), ang.sin()
    q = torch.randn(1, 1, 1, R, dtype=torch.float64).expand(1, S, 1, R)
    k = torch.randn(1, 1, 1, R, dtype=torch.float64).expand(1, S, 1, R)
    rq, rk = rope(q, cos, sin), rope(k, cos, sin)
    check(torch.allclose(rq.norm(dim=-1), q.norm(dim=-1)), "RoPE keeps each vector's norm")
    s1 = float((rq[0, 5, 0] * rk[0, 2, 0]).sum())
    s2 = float((rq[0, 9, 0] * rk[0, 6, 0]).sum())
    check(abs(s1 - s2) < 1e-10, "RoPE: q_i . k_j depends on i - j only")

    # The whole shard at tiny-ep sizes in fp64 on the CPU, loop experts and, where the CPU build has
    # it, torch._grouped_mm; capacity large enough that nothing drops.
    cfg = pm.moe_config(written_doc(yarn=True))
    cfg = dict(cfg, capacity_factor=8.0)
    cfg["capacity"] = pm.capacity_rows(cfg)
    model = pm.make_model(cfg, "loop", "cpu", torch.float64)
    model.stage_input = model.stage_input.double()
    model.stage_grad = model.stage_grad.double()
    for blk in model.blocks:
        blk.attn.pad_v = False
    moe = model.blocks[0].ffn
    h2 = torch.randn(cfg["tokens"], cfg["hidden"], dtype=torch.float64) * 0.5
    bias_before = moe.bias.clone()
    y, _ = moe(h2)
    idx2, w2, _ = route(torch.nn.functional.linear(h2.float(), moe.router.weight.float()), bias_before, cfg["groups"],
                        cfg["topk_groups"], cfg["topk"], cfg["route_scale"])

    def ffn(x, g, d):
        a_ = x @ g.t()
        gg, uu = a_.chunk(2, -1)
        return (torch.nn.functional.silu(gg) * uu) @ d.t()

    want = ffn(h2, moe.shared_gate_up.weight, moe.shared_down.weight)
    for t in range(cfg["tokens"]):
        for j in range(cfg["topk"]):
            e = int(idx2[t, j]) % cfg["local_experts"]
            want[t] += w2[t, j] * ffn(h2[t:t + 1], moe.gate_up[e], moe.down[e])[0]
    check(torch.allclose(y, want, rtol=1e-10, atol=1e-12) and int(moe.dropped) == 0,
          "MoE layer: shared expert + sum of the weighted routed experts (folded), nothing dropped")
    load = torch.zeros(cfg["experts"], dtype=torch.int64).scatter_add_(0, idx2.reshape(-1),
                                                                       torch.ones(idx2.numel(), dtype=torch.int64))
    step = torch.sign(load.sum() - cfg["experts"] * load).double() * cfg["bias_update_rate"]
    check(torch.equal(moe.bias - bias_before, step.to(moe.bias.dtype)) and bool((step != 0).any()),
          "bias update: +rate below the mean load, -rate above, in place")
    if hasattr(torch, "_grouped_mm"):
        x = torch.randn(cfg["local_experts"] * cfg["capacity"], cfg["hidden"], dtype=torch.bfloat16)
        wt = moe.gate_up.detach().to(torch.bfloat16)
        try:
            moe.experts_gemm = "grouped"
            g_out = moe.experts(x, wt)
            moe.experts_gemm = "loop"
            l_out = moe.experts(x, wt)
            check(torch.allclose(g_out.float(), l_out.float(), rtol=2e-2, atol=2e-2),
                  "experts: torch._grouped_mm equals the loop over experts")
        except (RuntimeError, NotImplementedError) as e:
            print(f"skip torch._grouped_mm on the CPU: {str(e).splitlines()[0]}")
        moe.experts_gemm = "loop"

    # Causality of the whole shard: the loss of the first position's output does not see the later
    # positions' inputs (the router's auxiliary loss and the load mix the sequence, so the blocks'
    # outputs are compared directly).
    x = model.stage_input.clone().requires_grad_(True)
    h = x
    for blk in model.blocks:
        h, _ = blk(h, model.cos, model.sin)
    g, = torch.autograd.grad(h[0, 0].sum(), x)
    check(float(g[0, 1:].abs().max()) == 0.0, "causal: position 0's output depends on no later position")

    # A training step's gradients are finite and reach every parameter.
    loss = model()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    check(all(gr is not None and bool(torch.isfinite(gr).all()) for gr in grads), "every parameter has a finite gradient")
    check(math.isfinite(float(loss)), f"loss {float(loss):.6g}")


def main():
    test_config()
    test_yarn()
    test_flops()
    test_torch()
    if FAILS:
        print(f"{len(FAILS)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
