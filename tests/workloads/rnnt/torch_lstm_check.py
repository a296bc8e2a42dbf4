#!/usr/bin/env python3
"""replay's cuDNN LSTM (workloads/rnnt/lstm.h) against torch.nn.LSTM.

--out-dir DIR: writes a few random ragged cases, computed by torch.nn.LSTM in float64 on the CPU
with packed sequences (so each sample stops at its own length), as DIR/case<k>.bin, for the GPU
test binary's LstmTorch suite, which runs replay's LSTM on the same inputs and weights (copied into
cuDNN's weight space by PyTorch's parameter names) and compares. File layout (little-endian):
int32 I, H, L, B, T, dtype (0 fp32, 1 fp16), batch_first; int32 lengths [B]; float32, in order:
per layer weight_ih, weight_hh, bias_ih, bias_hh; x [B, T, I]; h0, c0 [L, B, H]; dy [B, T, H];
dhn, dcn [L, B, H]; then torch's y [B, T, H] (zeros past the lengths), hn, cn, dx [B, T, I], dh0,
dc0, and the gradients of the four tensors per layer. The values are already representable in
the case's dtype. The gradients are of sum(dy * y) + sum(dhn * hn) + sum(dcn * cn).

--time: times torch.nn.LSTM on the GPU (fp16, cuDNN) at the MLPerf RNN-T shapes the GPU test's
LstmTiming suite prints, for comparison.

Exit codes: 0, or 77 (a CTest skip) where torch is not importable (or, for --time, has no GPU).
"""

import argparse
import os
import sys

SKIP = 77


def load_torch():
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        print(f"SKIPPED: torch is not importable ({e})")
        sys.exit(SKIP)
    return torch


def raw(tensor, code):
    """Little-endian bytes of a CPU tensor as float32 ('f') or int32 ('i')."""
    flat = tensor.detach().contiguous().reshape(-1)
    try:
        import numpy as np

        return flat.numpy().astype("<f4" if code == "f" else "<i4").tobytes()
    except ImportError:  # torch without numpy: slower, same bytes on a little-endian host
        import array

        return array.array(code, flat.tolist()).tobytes()


def make_case(torch, I, H, L, B, T, fp16, batch_first, seed):
    g = torch.Generator().manual_seed(seed)
    nn = torch.nn
    rnd = (lambda t: t.half().double()) if fp16 else (lambda t: t.float().double())
    lengths = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int64)
    lengths[0] = T
    lstm = nn.LSTM(I, H, L, batch_first=batch_first).double()
    k = 1.5 / H**0.5
    with torch.no_grad():
        for name, p in lstm.named_parameters():
            lo, hi = (-k, k) if name.startswith("weight") else (-0.5, 0.5)
            p.copy_(rnd(torch.rand(p.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo))
    x = rnd(torch.randn(B, T, I, generator=g, dtype=torch.float64))
    h0 = rnd(0.5 * torch.randn(L, B, H, generator=g, dtype=torch.float64))
    c0 = rnd(0.5 * torch.randn(L, B, H, generator=g, dtype=torch.float64))
    dy = rnd(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    dhn = rnd(torch.randn(L, B, H, generator=g, dtype=torch.float64))
    dcn = rnd(torch.randn(L, B, H, generator=g, dtype=torch.float64))
    for b in range(B):  # past the lengths: zeros (never read)
        x[b, lengths[b]:] = 0
        dy[b, lengths[b]:] = 0

    xr = x.clone().requires_grad_(True)
    h0r = h0.clone().requires_grad_(True)
    c0r = c0.clone().requires_grad_(True)
    inp = xr if batch_first else xr.transpose(0, 1)
    packed = nn.utils.rnn.pack_padded_sequence(inp, lengths, batch_first=batch_first,
                                               enforce_sorted=False)
    out, (hn, cn) = lstm(packed, (h0r, c0r))
    y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=T)
    loss = (y * dy).sum() + (hn * dhn).sum() + (cn * dcn).sum()
    loss.backward()

    head = torch.tensor([I, H, L, B, T, 1 if fp16 else 0, 1 if batch_first else 0])
    params = []
    grads = []
    for layer in range(L):
        for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            p = getattr(lstm, f"{kind}_l{layer}")
            params.append(p)
            grads.append(p.grad)
    parts = [raw(head, "i"), raw(lengths, "i")]
    parts += [raw(p, "f") for p in params]
    parts += [raw(t, "f") for t in (x, h0, c0, dy, dhn, dcn)]
    parts += [raw(t, "f") for t in (y, hn, cn, xr.grad, h0r.grad, c0r.grad)]
    parts += [raw(gr, "f") for gr in grads]
    return b"".join(parts)


def write_cases(torch, out_dir):
    cases = [  # I, H, L, B, T, fp16, batch_first
        (8, 16, 1, 4, 7, False, False),
        (12, 20, 2, 5, 9, False, True),
        (32, 64, 2, 6, 12, True, False),
    ]
    os.makedirs(out_dir, exist_ok=True)
    for i, (I, H, L, B, T, fp16, bf) in enumerate(cases):
        with open(os.path.join(out_dir, f"case{i}.bin"), "wb") as f:
            f.write(make_case(torch, I, H, L, B, T, fp16, bf, seed=2000 + i))
    print(f"torch {torch.__version__}: wrote {len(cases)} LSTM cases to {out_dir}")


def time_torch(torch):
    if not torch.cuda.is_available():
        print("SKIPPED: torch sees no GPU")
        return SKIP
    shapes = [  # what, I, H, L, T
        ("encoder pre-stack", 240, 1024, 2, 410),
        ("encoder post-stack", 2048, 1024, 3, 205),
        ("prediction", 512, 512, 2, 72),
    ]
    B = 192
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    for what, I, H, L, T in shapes:
        lstm = torch.nn.LSTM(I, H, L).to(dev).half()
        x = torch.randn(T, B, I, device=dev, dtype=torch.half, requires_grad=True)
        dy = torch.randn(T, B, H, device=dev, dtype=torch.half)

        def timed(fn):  # as the C++ test: 3 warm-up calls, the median of 5 batches of 4
            for _ in range(3):
                fn()
            batches = []
            for _ in range(5):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(4):
                    fn()
                end.record()
                end.synchronize()
                batches.append(start.elapsed_time(end) / 4)
            return sorted(batches)[2]

        def inference():
            with torch.no_grad():
                lstm(x)

        def forward():
            lstm(x)

        def step():
            y, _ = lstm(x)
            y.backward(dy)

        print(f"  torch.nn.LSTM {what} ({I} -> {H}, {L} layers, T {T}, B {B}, fp16): "
              f"inference {timed(inference):.2f} ms, training forward {timed(forward):.2f} ms, "
              f"forward + backward {timed(step):.2f} ms")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", help="write the cases here")
    parser.add_argument("--time", action="store_true", help="time torch.nn.LSTM on the GPU")
    args = parser.parse_args()
    torch = load_torch()
    if args.out_dir:
        write_cases(torch, args.out_dir)
    if args.time:
        return time_torch(torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
