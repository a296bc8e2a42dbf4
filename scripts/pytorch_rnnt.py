#!/usr/bin/env python3
"""PyTorch baseline for replay-rnnt: MLPerf's RNN-T in plain PyTorch on the same ladder of shapes.

The model is MLPerf's (torch.nn.LSTM on cuDNN: encoder 2 x 1024, time stacking x2, 3 x 1024;
prediction network: embedding 1024 x 512 and 2 x 512; joint 1024->512 + 512->512, ReLU, dropout,
512->1024), fp16 autocast with a GradScaler and fused Adam, every batch padded to a rung of the
ladder with every utterance at the rung's length (as replay's graphs run them). Two modes:

  eager    forward, backward and optimizer step as PyTorch runs them, the loss
           torchaudio.functional.rnnt_loss (blank last, mean over utterances);
  graphed  per rung, the whole step captured once with torch.cuda.graph (one memory pool shared
           by the rungs): zeroing the gradients, forward, loss, backward, GradScaler's inf check,
           fused Adam's step (capturable=True: it unscales and skips on overflow on the device) and
           the scale update. torchaudio's loss cannot be captured (its op converts through
           aten::to in torchaudio's stable ABI, which fails under capture), so this mode uses the
           transducer loss below, written in plain PyTorch and checked against torchaudio's
           (--check-loss: values and gradients on random shapes, and fp64 finite differences).
           With --capture forward-backward only forward, loss and backward are captured (a static
           loss scale) and fused Adam steps eagerly after the replay.

Both modes pick --loss torchaudio|torch (defaults: eager torchaudio, graphed torch). The data are
random features and transcripts (the timing does not depend on their values). Steps cycle through
the rungs in order; each rung's median step time and the overall utterances per second are printed
and, with --json, written. Every loss must be finite (the run fails otherwise).

  python3 scripts/pytorch_rnnt.py --mode eager --ladder 384x64,432x72,472x80,560x96 --batch 192
  python3 scripts/pytorch_rnnt.py --mode graphed --steps 4 --warmup 2 --json rnnt-graphed.json
  python3 scripts/pytorch_rnnt.py --check-loss          # the loss against torchaudio's
"""

import argparse
import json
import statistics
import sys
import time


def make_transducer_loss(torch):
    """The transducer (RNN-T) loss in plain PyTorch, capturable in a CUDA graph (static shapes, no
    host reads, no allocation whose size depends on data). Returns

      loss(logits [B, T, U+1, V], labels [B, U], frames [B], label_lengths [B], blank)
          -> per-utterance costs [B], fp32

    with the values and the gradient of torchaudio.functional.rnnt_loss(reduction="none",
    fused_log_softmax=True). Frames and label lengths may differ per utterance (1 <= frames[b] <=
    T, 0 <= label_lengths[b] <= U); the lattice cells outside them get no gradient.

    Two autograd functions:
      Gather   the log-probabilities the lattice reads: the log-softmax's normaliser lse (fp32, in
               slices of rows, so no fp32 copy of all the logits is kept), lp_blank[b, t, u] =
               logits[b, t, u, blank] - lse and lp_label[b, t, u] = logits[b, t, u, y_{u+1}] - lse;
               its backward is the log-softmax's, in the same slices, in the logits' type:
               d logits = Gb (e_blank - p) + Gl (e_y - p), p the softmax.
      Lattice  the alpha and beta recursions in log space over the T x (U+1) lattice, one
               anti-diagonal n = t + u per step (each cell depends only on the diagonal before),
               in a skewed layout [B, T + U, T] that holds cell (t, n - t) at [n, t]: four or five
               kernels a diagonal. Log-probabilities of cells outside an utterance are -inf, so
               its alphas and betas there are -inf and per-utterance lengths are exact. The cost
               is -beta(0, 0); the gradients of the log-probabilities are minus the edge
               posteriors exp(alpha + lp + beta(next) - log Z), computed in the forward (as
               torchaudio does) and scaled by the incoming gradient in the backward.
    """
    NEG = float("-inf")

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels, blank, rows_per_slice):
            B, T, P, V = logits.shape
            flat = logits.reshape(-1, V)
            acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
            lse = torch.empty(flat.shape[0], device=logits.device, dtype=acc)
            for r0 in range(0, flat.shape[0], rows_per_slice):
                lse[r0:r0 + rows_per_slice] = torch.logsumexp(
                    flat[r0:r0 + rows_per_slice].to(acc), dim=-1)
            lse = lse.reshape(B, T, P)
            # y_{u+1} for u < U; position U has no label (index 0: its transition leaves the
            # lattice, so the lattice gives it no gradient).
            y = torch.cat([labels.long(), labels.new_zeros(B, 1).long()], dim=1)  # [B, P]
            y = y[:, None, :, None].expand(B, T, P, 1)
            lp_label = logits.gather(3, y).squeeze(3).to(acc) - lse
            lp_blank = logits[..., blank].to(acc) - lse
            ctx.save_for_backward(logits, lse, y)
            ctx.blank, ctx.rows = blank, rows_per_slice
            return lp_blank, lp_label

        @staticmethod
        def backward(ctx, g_blank, g_label):
            logits, lse, y = ctx.saved_tensors
            V = logits.shape[-1]
            grad = torch.empty_like(logits)
            flat, gflat = logits.reshape(-1, V), grad.reshape(-1, V)
            gb, gl = g_blank.reshape(-1), g_label.reshape(-1)
            lse_f, y_f = lse.reshape(-1), y.reshape(-1)
            for r0 in range(0, flat.shape[0], ctx.rows):
                r1 = min(flat.shape[0], r0 + ctx.rows)
                g = torch.exp(flat[r0:r1].to(lse.dtype) - lse_f[r0:r1, None])
                g.mul_((-(gb[r0:r1] + gl[r0:r1]))[:, None])
                g[:, ctx.blank] += gb[r0:r1]
                g.scatter_add_(1, y_f[r0:r1, None], gl[r0:r1, None])
                gflat[r0:r1] = g
            return grad, None, None, None

    class Lattice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, lp_blank, lp_label, frames, label_lengths):
            B, T, P = lp_blank.shape
            N = T + P - 1  # anti-diagonals
            dev = lp_blank.device
            n_idx = torch.arange(N, device=dev)[:, None]
            t_idx = torch.arange(T, device=dev)[None, :]
            u_idx = n_idx - t_idx  # [N, T]: the label position of [n, t]
            Tb = frames.long()[:, None, None]
            Ub = label_lengths.long()[:, None, None]
            valid = (u_idx >= 0) & (u_idx <= Ub) & (t_idx < Tb)  # [B, N, T]
            terminal = (t_idx == Tb - 1) & (u_idx == Ub)  # each utterance's last cell
            ninf = lp_blank.new_full((), NEG)

            def skew(x):  # [B, T, P] -> [B, N, T]; -inf at cells outside the utterance
                pad = torch.cat([x, x.new_full((B, T, 1), NEG)], dim=2)
                u = torch.where((u_idx >= 0) & (u_idx < P), u_idx, torch.full_like(u_idx, P))
                out = pad.gather(2, u.t()[None].expand(B, T, N)).transpose(1, 2)
                return torch.where(valid, out, ninf)

            LB, LL = skew(lp_blank), skew(lp_label)  # by source cell
            # By target cell: EB[n, t] enters (t, u) from (t - 1, u), EL[n, t] from (t, u - 1).
            neg_col = LB.new_full((B, N - 1, 1), NEG)
            neg_row = LB.new_full((B, 1, T), NEG)
            EB = torch.cat([neg_row, torch.cat([neg_col, LB[:, :-1, :-1]], dim=2)], dim=1)
            EL = torch.cat([neg_row, LL[:, :-1]], dim=1)
            EB = torch.where(valid, EB, ninf)
            EL = torch.where(valid, EL, ninf)
            # alpha, column 0 a pad of -inf (cell t at column t + 1).
            A = LB.new_full((B, N, T + 1), NEG)
            A[:, 0, 1] = 0.0
            for n in range(1, N):
                torch.logaddexp(A[:, n - 1, :T] + EB[:, n], A[:, n - 1, 1:] + EL[:, n],
                                out=A[:, n, 1:])
            A = A[:, :, 1:]
            # beta (cell t at column t, a row and a column of -inf past the end), and at each
            # utterance's last cell the final blank alone.
            TERM = torch.where(terminal, LB, ninf)
            Bt = LB.new_full((B, N + 1, T + 1), NEG)
            for n in range(N - 1, -1, -1):
                v = torch.logaddexp(Bt[:, n + 1, 1:] + LB[:, n], Bt[:, n + 1, :T] + LL[:, n])
                torch.logaddexp(v, TERM[:, n], out=Bt[:, n, :T])
            log_z = Bt[:, 0, 0].clone()
            z = log_z[:, None, None]
            # Edge posteriors; the blank out of the last cell ends every path (beta 1 after it).
            beta_blank_next = torch.where(terminal, torch.zeros_like(LB), Bt[:, 1:, 1:])
            post_b = torch.exp(A + LB + beta_blank_next - z)
            post_l = torch.exp(A + LL + Bt[:, 1:, :T] - z)

            def unskew(x):  # [B, N, T] -> [B, T, P]
                idx = torch.arange(T, device=dev)[:, None] + torch.arange(P, device=dev)[None]
                return x.transpose(1, 2).gather(2, idx[None].expand(B, T, P))

            ctx.save_for_backward(unskew(post_b).neg_(), unskew(post_l).neg_())
            return -log_z

        @staticmethod
        def backward(ctx, g_cost):
            d_blank, d_label = ctx.saved_tensors
            g = g_cost.to(d_blank.dtype)[:, None, None]
            return d_blank * g, d_label * g, None, None

    def loss(logits, labels, frames, label_lengths, blank, rows_per_slice=1 << 16):
        lp_blank, lp_label = Gather.apply(logits, labels, blank, rows_per_slice)
        return Lattice.apply(lp_blank, lp_label, frames, label_lengths)

    loss.gather = Gather.apply
    loss.lattice = Lattice.apply
    return loss


def check_loss(torch, AF, device, cases=24, seed=0, out=sys.stdout):
    """The plain-PyTorch loss against torchaudio.functional.rnnt_loss on random ragged shapes
    (fp32 logits; blank last and first; per-utterance costs and the gradient of a weighted sum of
    them), one fp16 case on CUDA, and torch.autograd.gradcheck in fp64 (finite differences).
    Returns the number of failures."""
    loss = make_transducer_loss(torch)
    g = torch.Generator().manual_seed(seed)
    failures, worst_cost, worst_grad, worst_ta, worst_mine = 0, 0.0, 0.0, 0.0, 0.0

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    shapes = [(rand(1, 4), rand(2, 12), rand(1, 7), rand(3, 12)) for _ in range(cases)]
    shapes += [(3, 60, 20, 128), (2, 33, 9, 1024), (2, 140, 40, 256)]
    for i, (B, T, U, V) in enumerate(shapes):
        blank = V - 1 if i % 2 == 0 else 0
        # torchaudio needs the padding to equal the longest utterance, and its CUDA kernel at
        # least two frames and one label per utterance: utterance 0 is full, the rest ragged.
        frames = torch.randint(2, T + 1, (B,), generator=g, dtype=torch.int32)
        lab_len = torch.randint(1, U + 1, (B,), generator=g, dtype=torch.int32)
        frames[0], lab_len[0] = T, U
        labels = torch.randint(0, V - 1, (B, U), generator=g, dtype=torch.int32)
        labels = labels + (labels >= blank).to(torch.int32)
        logits = 2.0 * torch.randn(B, T, U + 1, V, generator=g)
        w = torch.rand(B, generator=g) + 0.5
        frames, lab_len, labels, w = (x.to(device) for x in (frames, lab_len, labels, w))
        l1 = logits.to(device).clone().requires_grad_()  # separate leaves (.to may not copy)
        l2 = logits.to(device).clone().requires_grad_()
        l64 = logits.to(device, torch.float64).requires_grad_()
        c1 = AF.rnnt_loss(l1, labels, frames, lab_len, blank=blank, reduction="none")
        c2 = loss(l2, labels, frames, lab_len, blank)
        c64 = loss(l64, labels, frames, lab_len, blank)
        for c in (c1, c2, c64):
            (c * w.to(c.dtype)).sum().backward()
        e_cost = float(((c1.double() - c2.double()).abs() / c1.double().abs().clamp_min(1.0))
                       .max().detach())
        # Both fp32 gradients carry the rounding of log-space sums of some hundreds of nats (about
        # 1e-4: fp32's 6e-8 times costs of 300 to 1,000 and a few roundings): each is measured
        # against this loss in fp64 (checked by finite differences below), and this one may be at
        # most twice as far from it as torchaudio's, or 2e-4.
        e_ta = float((l1.grad.double() - l64.grad).abs().max())
        e_mine = float((l2.grad.double() - l64.grad).abs().max())
        e_grad = float((l1.grad - l2.grad).abs().max())
        worst_cost, worst_grad = max(worst_cost, e_cost), max(worst_grad, e_grad)
        worst_ta, worst_mine = max(worst_ta, e_ta), max(worst_mine, e_mine)
        if not (e_cost <= 1e-5 and e_mine <= max(2e-4, 2.0 * e_ta)):
            failures += 1
            print(f"check-loss: case {i} B={B} T={T} U={U} V={V} blank={blank}: cost error "
                  f"{e_cost:.3g}; gradient error {e_mine:.3g} from fp64, torchaudio's "
                  f"{e_ta:.3g}", file=out)
    print(f"check-loss: {len(shapes)} fp32 cases on {device} against torchaudio: worst relative "
          f"cost difference {worst_cost:.3g}, worst gradient difference {worst_grad:.3g}; from "
          f"the fp64 loss: this loss's gradients {worst_mine:.3g}, torchaudio's {worst_ta:.3g}",
          file=out)
    if str(device).startswith("cuda"):  # fp16 logits, as the graphed baseline feeds them
        B, T, U, V = 4, 40, 12, 1024
        frames = torch.full((B,), T, dtype=torch.int32, device=device)
        lab_len = torch.full((B,), U, dtype=torch.int32, device=device)
        labels = torch.randint(0, V - 1, (B, U), generator=g, dtype=torch.int32).to(device)
        logits = (2.0 * torch.randn(B, T, U + 1, V, generator=g)).half().to(device)
        l1, l2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        c1 = AF.rnnt_loss(l1, labels, frames, lab_len, blank=V - 1, reduction="none")
        c2 = loss(l2, labels, frames, lab_len, V - 1)
        c1.float().sum().backward()
        c2.sum().backward()
        e_cost = float(((c1.float() - c2).abs() / c2.abs()).max().detach())
        e_grad = float((l1.grad.float() - l2.grad.float()).abs().max())
        ok = e_cost <= 2e-3 and e_grad <= 2e-3
        failures += 0 if ok else 1
        print(f"check-loss: fp16 logits {B}x{T}x{U + 1}x{V}: relative cost error {e_cost:.3g}, "
              f"gradient error {e_grad:.3g} (torchaudio's fp16 costs){'' if ok else ': FAILED'}",
              file=out)
    # fp64 finite differences (torchaudio has no fp64 loss): ragged lengths, a zero-label utterance.
    logits = torch.randn(3, 5, 4, 6, dtype=torch.float64, generator=g).to(device)
    labels = torch.randint(0, 5, (3, 3), generator=g, dtype=torch.int32).to(device)
    frames = torch.tensor([5, 3, 1], dtype=torch.int32, device=device)
    lab_len = torch.tensor([3, 1, 0], dtype=torch.int32, device=device)
    ok = torch.autograd.gradcheck(lambda x: loss(x, labels, frames, lab_len, 5),
                                  (logits.requires_grad_(),), raise_exception=False)
    failures += 0 if ok else 1
    print(f"check-loss: fp64 gradcheck (finite differences): {'passed' if ok else 'FAILED'}",
          file=out)
    return failures


def parse_ladder(text):
    rungs = []
    for part in text.split(","):
        t, u = part.lower().split("x")
        rungs.append((int(t), int(u)))
    return rungs


def main(argv=None):
    ap = argparse.ArgumentParser(prog="pytorch_rnnt.py", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["eager", "graphed"], default="eager")
    ap.add_argument("--loss", choices=["torchaudio", "torch"], default="",
                    help="the transducer loss: torchaudio's rnnt_loss (eager's default) or the "
                         "plain-PyTorch one (graphed's default and only choice)")
    ap.add_argument("--capture", choices=["step", "forward-backward"], default="step",
                    help="graphed: capture the whole step (optimizer and scaler included) or only "
                         "forward, loss and backward (a static loss scale, the optimizer eager)")
    ap.add_argument("--ladder", default="384x64,432x72,472x80,560x96",
                    help="rungs as input frames x labels, comma-separated")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per rung")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per rung")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check-loss", action="store_true",
                    help="compare the plain-PyTorch loss with torchaudio's and exit")
    args = ap.parse_args(argv)
    loss_kind = args.loss or ("torchaudio" if args.mode == "eager" else "torch")
    if args.mode == "graphed" and loss_kind != "torch":
        ap.error("--mode graphed: torchaudio's rnnt_loss cannot be captured (use --loss torch)")
    if args.batch < 1 or args.steps < 1 or args.warmup < 1:
        ap.error("--batch, --steps and --warmup must be at least 1")
    try:
        rungs = parse_ladder(args.ladder)
    except ValueError:
        ap.error(f"--ladder {args.ladder!r}: expected FRAMESxLABELS[,...]")
    for (T, U) in rungs:
        if T < 2 or T % 2 or U < 1:
            ap.error(f"--ladder: rung {T}x{U} needs even frames >= 2 and labels >= 1")

    try:
        import torch
        import torch.nn as nn
        import torchaudio.functional as AF
    except Exception as e:
        print(f"pytorch_rnnt.py: torch with torchaudio is not importable ({e})")
        return 77
    if args.check_loss:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return 1 if check_loss(torch, AF, device) else 0
    if not torch.cuda.is_available():
        print("pytorch_rnnt.py: no CUDA device")
        return 77
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    F_IN, H, HP, J, V = 240, 1024, 512, 512, 1024
    blank = V - 1
    graphed = args.mode == "graphed"
    whole_step = graphed and args.capture == "step"
    transducer = make_transducer_loss(torch)

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
    # capturable=True lets fused Adam's step (and its step counters) be captured; it takes
    # GradScaler's scale and inf flag as device tensors, so nothing is read on the host.
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-9, fused=True,
                           capturable=whole_step)
    scaler = torch.amp.GradScaler("cuda", init_scale=32768.0)
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
        # Under capture autocast's weight-cast cache must be off (PyTorch's graph rules).
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=not graphed):
            e, q = model.encode(x, tokens)
        if loss_kind == "torch":
            # The log-probabilities per chunk (each chunk's logits freed by its backward), then
            # one lattice recursion over the whole batch.
            lp_b, lp_l = [], []
            for b0 in range(0, B, chunk):
                with torch.autocast("cuda", dtype=torch.float16, cache_enabled=not graphed):
                    logits = model.joint(e[b0:b0 + chunk], q[b0:b0 + chunk])
                pb, pl = transducer.gather(logits, labels[b0:b0 + chunk], blank, 1 << 18)
                lp_b.append(pb)
                lp_l.append(pl)
            costs = transducer.lattice(torch.cat(lp_b), torch.cat(lp_l), frames, lab_len)
            return costs.sum() / B
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

    def step_eager(data):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(*data)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    captured = ("none" if not graphed else
                "zero_grad, forward, loss, backward, GradScaler inf check, fused Adam step "
                "(capturable), scale update" if whole_step else
                "forward, loss, backward (static loss scale); fused Adam eager")
    results = {"mode": args.mode, "loss": loss_kind, "captured": captured, "batch": B,
               "parameters": params, "rungs": []}
    static_scale = 1024.0
    pool = torch.cuda.graph_pool_handle() if graphed else None
    graphs = {}
    torch.cuda.reset_peak_memory_stats()
    t_capture = 0.0
    if graphed:
        # Warm up every rung on a side stream (PyTorch's recipe): it creates the gradients, the
        # optimizer's state and the scaler's tensors before any capture, so the captures allocate
        # only activations (from the shared pool) and every graph adds into the same gradients.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for (T, U) in rungs:
                data = batch(T, U)
                for _ in range(args.warmup):
                    if whole_step:
                        step_eager(data)
                    else:
                        opt.zero_grad(set_to_none=False)
                        (loss_of(*data) * static_scale).backward()
        torch.cuda.current_stream().wait_stream(s)
        for p in model.parameters():  # gradients that stay, zeroed inside each graph
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for (T, U) in rungs:
            data = batch(T, U)
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.graph(g, pool=pool):
                opt.zero_grad(set_to_none=False)
                static_loss = loss_of(*data)
                if whole_step:
                    scaler.scale(static_loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    (static_loss * static_scale).backward()
            torch.cuda.synchronize()
            t_capture += time.perf_counter() - t0
            graphs[(T, U)] = (g, data, static_loss)
    times = {r: [] for r in rungs}
    losses = []
    for step in range(args.warmup + args.steps):
        for (T, U) in rungs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if not graphed:
                data = batch(T, U)
                start.record()
                loss = step_eager(data)
                end.record()
            else:
                g, data, loss = graphs[(T, U)]
                start.record()
                g.replay()
                if not whole_step:
                    grads = [p.grad for p in model.parameters()]
                    torch._foreach_div_(grads, static_scale)
                    opt.step()
                end.record()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times[(T, U)].append(start.elapsed_time(end))
                losses.append(float(loss.detach()))
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
    results["loss_scale"] = float(scaler.get_scale())
    results["torch"] = torch.__version__
    print(f"{args.mode}: {results['utterances_per_s']:.0f} utterances/s over the ladder, mean step "
          f"{results['mean_step_ms']:.2f} ms, peak memory "
          f"{results['peak_memory_bytes'] / 2**30:.2f} GiB, capture {t_capture:.2f} s, "
          f"{params / 1e6:.2f}M parameters, loss {loss_kind}, captured: {captured}")
    print(f"losses: first {losses[0]:.3f}, last {losses[-1]:.3f}, loss scale "
          f"{results['loss_scale']:.0f}")
    bad = [x for x in losses if x != x or x in (float("inf"), float("-inf"))]
    results["losses_finite"] = not bad
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if bad:  # a step whose loss overflowed is not the step being compared (the scaler skips it)
        print(f"pytorch_rnnt.py: {len(bad)} of {len(losses)} losses are not finite",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
