#!/usr/bin/env python3
"""replay's transducer loss against torchaudio.functional.rnnt_loss.

For a few random ragged cases (fp32 and fp16 logits, the blank last as in MLPerf and first), this
computes torchaudio's per-utterance losses and the gradient of their sum (in fp32, on logits
already rounded to the case's dtype), writes each case to a binary file and runs the GPU test
binary's TransducerTorch suite on it (REPLAY_RNNT_TORCH_CASE=<file>), which runs replay's kernels
on the same inputs and compares. File layout (little-endian): int32 B, T, U, V, blank, dtype (0
fp32, 1 fp16); float32 logits [B, T, U+1, V]; int32 labels [B, U], frame lengths [B], label
lengths [B]; float32 losses [B] and gradient [B, T, U+1, V].

Exit codes: 0 when every case passes, 77 (a CTest skip) where torch with torchaudio's rnnt_loss is
not importable or the binary skips (no GPU), 1 otherwise.
"""

import argparse
import os
import subprocess
import sys
import tempfile

SKIP = 77


def load_torch():
    try:
        import torch
        import torchaudio.functional as F

        F.rnnt_loss  # absent from some torchaudio builds
    except Exception as e:  # ImportError, AttributeError, or a broken install
        print(f"SKIPPED: torch with torchaudio.functional.rnnt_loss is not importable ({e})")
        sys.exit(SKIP)
    return torch, F


def make_case(torch, F, B, T, U, V, blank, fp16, seed):
    g = torch.Generator().manual_seed(seed)
    # torchaudio requires the padding to equal the longest utterance: utterance 0 is full. Every
    # utterance has at least two frames and one label: torchaudio's CUDA kernel writes no loss for
    # one frame or an empty transcript (its beta pass starts at t = T_b - 2, u = U_b - 1 and
    # returns at once), which replay's GPU test covers against the fp64 reference instead.
    frames = torch.randint(2, T + 1, (B,), generator=g, dtype=torch.int32)
    labels_len = torch.randint(1, U + 1, (B,), generator=g, dtype=torch.int32)
    frames[0], labels_len[0] = T, U
    labels = torch.randint(0, V - 1, (B, U), generator=g, dtype=torch.int32)
    labels = labels + (labels >= blank).to(torch.int32)  # anything but the blank
    logits = 2.0 * torch.randn(B, T, U + 1, V, generator=g)
    if fp16:
        logits = logits.half().float()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    z = logits.to(device).requires_grad_(True)
    loss = F.rnnt_loss(z, labels.to(device), frames.to(device), labels_len.to(device),
                       blank=blank, reduction="none")
    loss.sum().backward()
    return dict(B=B, T=T, U=U, V=V, blank=blank, fp16=fp16, logits=logits, labels=labels,
                frames=frames, labels_len=labels_len, loss=loss.detach().float().cpu(),
                grad=z.grad.detach().float().cpu())


def probe_short_utterances(torch, F):
    """Prints torchaudio's losses for utterances of one frame or no labels, on the GPU and the CPU
    (informational: the reason the cases above avoid them)."""
    if not torch.cuda.is_available():
        return
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 4, 3, 5, generator=g)
    labels = torch.tensor([[1, 2], [1, 2], [1, 2]], dtype=torch.int32)
    frames = torch.tensor([4, 1, 4], dtype=torch.int32)
    labels_len = torch.tensor([2, 2, 0], dtype=torch.int32)
    out = {}
    for device in ("cpu", "cuda"):
        try:
            out[device] = F.rnnt_loss(logits.to(device), labels.to(device), frames.to(device),
                                      labels_len.to(device), blank=0, reduction="none").cpu()
        except Exception as e:
            out[device] = f"error: {e}"
    print(f"torchaudio probe, (T_b, U_b) = (4, 2), (1, 2), (4, 0): cpu {out['cpu']}, "
          f"cuda {out['cuda']}")


def raw(tensor, code):
    """Little-endian bytes of a CPU tensor as float32 ('f') or int32 ('i')."""
    flat = tensor.contiguous().reshape(-1)
    try:
        import numpy as np

        return flat.numpy().astype("<f4" if code == "f" else "<i4").tobytes()
    except ImportError:  # torch without numpy: slower, same bytes on a little-endian host
        import array

        return array.array(code, flat.tolist()).tobytes()


def write_case(path, c):
    import torch

    head = torch.tensor([c["B"], c["T"], c["U"], c["V"], c["blank"], 1 if c["fp16"] else 0])
    with open(path, "wb") as f:
        f.write(raw(head, "i"))
        f.write(raw(c["logits"], "f"))
        f.write(raw(c["labels"], "i"))
        f.write(raw(c["frames"], "i"))
        f.write(raw(c["labels_len"], "i"))
        f.write(raw(c["loss"], "f"))
        f.write(raw(c["grad"], "f"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="the test_transducer_gpu executable")
    args = parser.parse_args()
    torch, F = load_torch()
    probe_short_utterances(torch, F)

    cases = [  # B, T, U, V, blank, fp16
        (4, 30, 12, 64, 63, False),
        (3, 50, 20, 1024, 1023, True),
        (5, 17, 40, 33, 0, False),
        (2, 80, 70, 1024, 1023, True),
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (B, T, U, V, blank, fp16) in enumerate(cases):
            c = make_case(torch, F, B, T, U, V, blank, fp16, seed=1000 + i)
            path = os.path.join(tmp, f"case{i}.bin")
            write_case(path, c)
            env = dict(os.environ, REPLAY_RNNT_TORCH_CASE=path)
            r = subprocess.run([args.binary, "--gtest_filter=TransducerTorch.*"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            print(r.stdout, end="")
            results.append(r.returncode)
    if all(rc == SKIP for rc in results):
        return SKIP
    return 0 if all(rc == 0 for rc in results) else 1


if __name__ == "__main__":
    sys.exit(main())
