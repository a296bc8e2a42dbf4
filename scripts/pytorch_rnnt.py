#!/usr/bin/env python3
"""PyTorch baseline for replay-rnnt: MLPerf's RNN-T in plain PyTorch on the same ladder of shapes.

The model is MLPerf's (torch.nn.LSTM on cuDNN: encoder 2 x 1024, time stacking x2, 3 x 1024;
prediction network: embedding 1024 x 512 and 2 x 512; joint 1024->512 + 512->512, ReLU, dropout,
512->1024), the loss torchaudio.functional.rnnt_loss (blank last, mean over utterances), fp16
autocast with a GradScaler and fused Adam, every batch padded to a rung of the ladder with every
utterance at the rung's length (as replay's graphs run them). Two modes:

  eager    forward, backward and optimizer step as PyTorch runs them;
  graphed  per rung, forward and backward captured once with torch.cuda.graph (static inputs, one
           memory pool shared by the rungs, a static loss scale inside the graph), the fused Adam
           step eager after the replay: what make_graphed_callables gives a training loop.

The data are random features and transcripts (the timing does not depend on their values). Steps
cycle through the rungs in order; each rung's median step time and the overall utterances per
second are printed and, with --json, written.

  python3 scripts/pytorch_rnnt.py --mode eager --ladder 384x64,432x72,472x80,560x96 --batch 192
"""

import argparse
import json
import statistics
import sys
import time


def parse_ladder(text):
    rungs = []
    for part in text.split(","):
        t, u = part.lower().split("x")
        rungs.append((int(t), int(u)))
    return rungs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["eager", "graphed"], default="eager")
    ap.add_argument("--ladder", default="384x64,432x72,472x80,560x96",
                    help="rungs as input frames x labels, comma-separated")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per rung")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per rung")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    try:
        import torch
        import torch.nn as nn
        import torchaudio.functional as AF
    except Exception as e:
        print(f"pytorch_rnnt.py: torch with torchaudio is not importable ({e})")
        return 77
    if not torch.cuda.is_available():
        print("pytorch_rnnt.py: no CUDA device")
        return 77
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    F_IN, H, HP, J, V = 240, 1024, 512, 512, 1024
    blank = V - 1

    class RNNT(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.LSTM(F_IN, H, num_layers=2, batch_first=True, dropout=0.1)
            self.post = nn.LSTM(2 * H, H, num_layers=3, batch_first=True, dropout=0.1)
            self.embed = nn.Embedding(V, HP)
            self.pred = nn.LSTM(HP, HP, num_layers=2, batch_first=True, dropout=0.3)
            self.enc_proj = nn.Linear(H, J)
            self.pred_proj = nn.Linear(HP, J)
            self.out = nn.Linear(J, V)
            self.drop_enc = nn.Dropout(0.1)
            self.drop_pred = nn.Dropout(0.3)
            self.drop_joint = nn.Dropout(0.3)
            for lstm in (self.pre, self.post, self.pred):  # MLPerf's init
                for name, p in lstm.named_parameters():
                    if "bias_ih" in name:
                        with torch.no_grad():
                            p[lstm.hidden_size:2 * lstm.hidden_size].fill_(1.0)
                    elif "bias_hh" in name:
                        with torch.no_grad():
                            p[lstm.hidden_size:2 * lstm.hidden_size].fill_(0.0)
                    with torch.no_grad():
                        p.mul_(0.5)

        def encode(self, x, tokens):
            B, T, _ = x.shape
            y, _ = self.pre(x)
            y = self.drop_enc(y).reshape(B, T // 2, 2 * H)  # time stacking x2
            enc, _ = self.post(y)
            enc = self.drop_enc(enc)
            p, _ = self.pred(self.embed(tokens))
            return self.enc_proj(enc), self.pred_proj(self.drop_pred(p))

        def joint(self, e, q):
            h = e[:, :, None, :] + q[:, None, :, :]
            return self.out(self.drop_joint(torch.relu(h)))

    model = RNNT().to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-9, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=32768.0)
    rungs = parse_ladder(args.ladder)
    B = args.batch

    def batch(T, U):
        x = torch.randn(B, T, F_IN, device=dev)
        labels = torch.randint(0, V - 1, (B, U), device=dev, dtype=torch.int32)
        tokens = torch.cat([torch.full((B, 1), blank, device=dev, dtype=torch.int64),
                            labels.long()], dim=1)
        frames = torch.full((B,), T // 2, device=dev, dtype=torch.int32)
        lab_len = torch.full((B,), U, device=dev, dtype=torch.int32)
        return x, tokens, labels, frames, lab_len

    def loss_of(x, tokens, labels, frames, lab_len):
        # torchaudio's rnnt_loss fails past 2^31 logits (an illegal memory access at MLPerf's
        # sizes), so the joint and the loss run in chunks of utterances below that: the same sum.
        per = (x.shape[1] // 2) * tokens.shape[1] * V
        chunk = max(1, min(B, (2**31 - 1) // per))
        with torch.autocast("cuda", dtype=torch.float16):
            e, q = model.encode(x, tokens)
        total = 0.0
        for b0 in range(0, B, chunk):
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model.joint(e[b0:b0 + chunk], q[b0:b0 + chunk])
            # fp16 logits straight into the loss (outside autocast, which would upcast them). Each
            # utterance's cost (about (T/2 + U) ln V, some 1,800 nats at these sizes) fits fp16, but
            # their sum over a chunk does not (65,504): summed in fp32, or the loss is Inf.
            costs = AF.rnnt_loss(logits, labels[b0:b0 + chunk], frames[b0:b0 + chunk],
                                 lab_len[b0:b0 + chunk], blank=blank, reduction="none")
            total = total + costs.float().sum()
        return total / B

    results = {"mode": args.mode, "batch": B, "parameters": params, "rungs": []}
    static_scale = 1024.0
    pool = torch.cuda.graph_pool_handle() if args.mode == "graphed" else None
    graphs = {}
    torch.cuda.reset_peak_memory_stats()
    t_capture = 0.0
    for (T, U) in rungs:
        data = batch(T, U)
        if args.mode == "graphed":
            # Warm up on a side stream (PyTorch's recipe), then capture forward + backward.
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(args.warmup):
                    opt.zero_grad(set_to_none=False)
                    (loss_of(*data) * static_scale).backward()
            torch.cuda.current_stream().wait_stream(s)
            # The gradients stay the same tensors for every rung's graph (the backward in each
            # capture adds into them), zeroed before each replay.
            opt.zero_grad(set_to_none=False)
            g = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(g, pool=pool):
                static_loss = loss_of(*data)
                (static_loss * static_scale).backward()
            torch.cuda.synchronize()
            t_capture += time.perf_counter() - t0
            graphs[(T, U)] = (g, data, static_loss)
    times = {r: [] for r in rungs}
    losses = []
    for step in range(args.warmup + args.steps):
        for (T, U) in rungs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if args.mode == "eager":
                data = batch(T, U)
                start.record()
                opt.zero_grad(set_to_none=True)
                loss = loss_of(*data)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                end.record()
            else:
                g, data, loss = graphs[(T, U)]
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                start.record()
                torch._foreach_zero_(grads)
                g.replay()
                torch._foreach_div_(grads, static_scale)
                opt.step()
                end.record()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times[(T, U)].append(start.elapsed_time(end))
                losses.append(float(loss))
    total_ms = 0.0
    for (T, U) in rungs:
        med = statistics.median(times[(T, U)])
        total_ms += med
        results["rungs"].append({"frames": T, "labels": U, "median_ms": med,
                                 "utterances_per_s": B / med * 1e3})
        print(f"{args.mode:8s} rung {T}x{U}: median {med:.2f} ms, {B / med * 1e3:.0f} utt/s")
    results["mean_step_ms"] = total_ms / len(rungs)
    results["utterances_per_s"] = B * len(rungs) / total_ms * 1e3
    results["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    results["capture_s"] = t_capture
    results["losses"] = losses
    results["torch"] = torch.__version__
    print(f"{args.mode}: {results['utterances_per_s']:.0f} utterances/s over the ladder, mean step "
          f"{results['mean_step_ms']:.2f} ms, peak memory "
          f"{results['peak_memory_bytes'] / 2**30:.2f} GiB, capture {t_capture:.2f} s, "
          f"{params / 1e6:.2f}M parameters")
    bad = [x for x in losses if x != x or x in (float("inf"), float("-inf"))]
    results["losses_finite"] = not bad
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if bad:  # a step whose loss overflowed is not the step being compared (the scaler skips it)
        print(f"pytorch_rnnt.py: {len(bad)} of {len(losses)} losses are not finite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
