#!/usr/bin/env python3
"""pytorch_moe.py: the routed experts' GEMMs of replay-moe's 671b-ep32 shard in PyTorch, timed
side by side with replay's (issue 30's anchor): gate+up (hidden -> 2 x ffn) and down (ffn ->
hidden) over the 8 local experts, with torch._grouped_mm where this PyTorch has it (else a loop
over experts), at even counts (tokens-per-expert each) and uneven ones (1024 to 8192 per expert,
the same total), next to one dense GEMM over all rows. Prints one JSON object.

  python3 scripts/pytorch_moe.py [--experts 8] [--tokens-per-expert 4096] [--hidden 7168]
                                 [--ffn 2048] [--reps 20] [--json PATH]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens-per-expert", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
