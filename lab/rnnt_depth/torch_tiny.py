#!/usr/bin/env python3
"""replay-rnnt's tiny preset rebuilt in PyTorch on the CPU, trained on the same HDF5 speech file:
does the synthetic speech learn, and at which encoder depth? (lab/rnnt_depth/README.md)

Needs torch, h5py and numpy; the transducer loss is scripts/pytorch_rnnt.py's plain-PyTorch one."""
import argparse, os, time
import sys
import h5py, numpy as np, torch, torch.nn as nn
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'scripts'))
import pytorch_rnnt

ap = argparse.ArgumentParser()
ap.add_argument("--data", required=True, help="a replay-rnnt-data file (README.md: the tiny one)")
ap.add_argument("--steps", type=int, default=1000)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--eval-every", type=int, default=250)
ap.add_argument("--hold", type=int, default=10**9, help="steps at peak lr, then x0.9 per 28 steps")
ap.add_argument("--enc", type=int, default=128)
ap.add_argument("--pred", type=int, default=64)
ap.add_argument("--joint", type=int, default=64)
ap.add_argument("--pre", type=int, default=2)
ap.add_argument("--post", type=int, default=3)
ap.add_argument("--drop", type=float, default=1.0, help="scale of the dropouts (1: MLPerf's)")
ap.add_argument("--init-scale", type=float, default=0.5)
ap.add_argument("--fbias", type=float, default=1.0)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.manual_seed(a.seed); torch.set_num_threads(a.threads)
f = h5py.File(a.data)
feats = torch.tensor(f["features"][:].astype(np.float32))
fo, lo, labels = f["frame_offsets"][:], f["label_offsets"][:], f["labels"][:]
N, E, V = int(f.attrs["num_utterances"]), int(f.attrs["num_eval"]), int(f.attrs["vocab_size"])
blank = V
ntrain = N - E

def utt(i):
    return feats[fo[i]:fo[i + 1]], torch.tensor(labels[lo[i]:lo[i + 1]], dtype=torch.long)

def lstm(i, h, n, d):
    m = nn.LSTM(i, h, n, batch_first=True, dropout=d if n > 1 else 0.0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.mul_(a.init_scale)
            if name.startswith("bias_ih"):
                p[h:2 * h].fill_(a.fbias)  # forget gate (PyTorch's gate order i, f, g, o)
            if name.startswith("bias_hh"):
                p[h:2 * h].fill_(0.0)
    return m

class RNNT(nn.Module):
    def __init__(s):
        super().__init__()
        s.pre = lstm(240, a.enc, a.pre, 0.1 * a.drop)
        s.post = lstm(2 * a.enc, a.enc, a.post, 0.1 * a.drop)
        s.emb = nn.Embedding(V + 1, a.pred)
        s.pred = lstm(a.pred, a.pred, 2, 0.3 * a.drop)
        s.je, s.jp = nn.Linear(a.enc, a.joint), nn.Linear(a.pred, a.joint)
        s.jo = nn.Linear(a.joint, V + 1)
        s.d1, s.d2, s.d3 = nn.Dropout(0.1 * a.drop), nn.Dropout(0.3 * a.drop), nn.Dropout(0.3 * a.drop)
    def encode(s, x):  # [B, T, 240], T even
        y, _ = s.pre(x); y = s.d1(y)
        B, T, H = y.shape
        y = y.reshape(B, T // 2, 2 * H)
        y, _ = s.post(y); return s.d1(y)
    def predict(s, tokens, state=None):
        y, st = s.pred(s.emb(tokens), state); return s.d2(y), st
    def joint(s, e, q):  # e [B, T, 1, J], q [B, 1, U, J]
        return s.jo(s.d3(torch.relu(e + q)))

m = RNNT()
LOSS = pytorch_rnnt.make_transducer_loss(torch)
opt = torch.optim.AdamW(m.parameters(), lr=a.lr, eps=1e-9, weight_decay=1e-3)
rng = np.random.default_rng(a.seed)

def batch(ids):
    xs, ys = zip(*[utt(i) for i in ids])
    T = max(x.shape[0] for x in xs); T += T % 2
    U = max(y.shape[0] for y in ys)
    x = torch.zeros(len(ids), T, 240); y = torch.full((len(ids), U), 0, dtype=torch.long)
    for b, (xi, yi) in enumerate(zip(xs, ys)):
        x[b, :xi.shape[0]] = xi; y[b, :yi.shape[0]] = yi
    xl = torch.tensor([(x_.shape[0] + 1) // 2 for x_ in xs], dtype=torch.int32)
    yl = torch.tensor([y_.shape[0] for y_ in ys], dtype=torch.int32)
    return x, y, xl, yl

def greedy(ids):
    m.eval(); errs = 0; ref = 0
    with torch.no_grad():
        for i in ids:
            x, y = utt(i)
            T = x.shape[0] + x.shape[0] % 2
            xp = torch.zeros(1, T, 240); xp[0, :x.shape[0]] = x
            e = m.je(m.encode(xp))[0][: (x.shape[0] + 1) // 2]
            hyp = []; tok = torch.tensor([[blank]]); q, st = m.predict(tok)
            for t in range(e.shape[0]):
                for _ in range(30):
                    k = int(m.jo(torch.relu(e[t] + m.jp(q[0, 0]))).argmax())
                    if k == blank: break
                    hyp.append(k); q, st = m.predict(torch.tensor([[k]]), st)
            errs += edit(hyp, y.tolist()); ref += len(y)
    m.train(); return errs / ref

def edit(h, r):
    d = list(range(len(r) + 1))
    for i in range(1, len(h) + 1):
        p, d[0] = d[0], i
        for j in range(1, len(r) + 1):
            p, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, p + (h[i - 1] != r[j - 1]))
    return d[len(r)]

t0 = time.time(); order = []
for step in range(1, a.steps + 1):
    if not order: order = list(rng.permutation(ntrain))
    ids = [order.pop() for _ in range(min(a.batch, len(order)))]
    x, y, xl, yl = batch(ids)
    e = m.je(m.encode(x))
    tokens = torch.cat([torch.full((y.shape[0], 1), blank), y], 1)
    q = m.jp(m.predict(tokens)[0])
    logits = m.joint(e[:, :, None], q[:, None])
    lr = a.lr * (0.9 ** max(0.0, (step - a.hold) / 28))
    for g in opt.param_groups: g["lr"] = max(lr, 1e-5)
    loss = LOSS(logits, y, xl.long(), yl.long(), blank).mean()
    opt.zero_grad(); loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if step % 50 == 0: print(f"step {step} loss {loss.item():.3f} gnorm {gn:.2f} lr {lr:.2e} {time.time()-t0:.0f}s", flush=True)
    if step % a.eval_every == 0: print(f"eval step {step} wer {greedy(range(ntrain, N)):.4f}", flush=True)
