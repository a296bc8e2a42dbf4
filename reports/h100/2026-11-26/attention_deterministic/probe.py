#!/usr/bin/env python3
"""What PyTorch's attention forward+backward does and costs under torch.use_deterministic_algorithms(True),
at the two shards' attention shapes, timed with pytorch_baseline.py's own Timer and tensor layout.

For each shape and each of {default selection, cudnn, flash, efficient} with determinism off and on:
which kernels ran (profiler), whether dQKV is bit-identical over three runs, and the per-call times
(three rounds, alternating off/on). Prints one JSON document to stdout.
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "scripts"))
import pytorch_baseline as pb  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def make(shape):
    B, Hq, Hkv, S, D = (shape[k] for k in ("batch", "q_heads", "kv_heads", "seq", "head_dim"))
    gqa = Hkv != Hq
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, S, Hq + 2 * Hkv, D, dtype=torch.bfloat16, device="cuda", generator=g).requires_grad_()
    dout = torch.randn(B, Hq, S, D, dtype=torch.bfloat16, device="cuda", generator=g)

    def fwd_bwd():
        q, k, v = (qkv[:, :, :Hq].transpose(1, 2), qkv[:, :, Hq:Hq + Hkv].transpose(1, 2),
                   qkv[:, :, Hq + Hkv:].transpose(1, 2))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return torch.autograd.grad(o, (qkv,), grad_outputs=dout)[0]
    return fwd_bwd


def kernels_of(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    return [n[:140] for n in names]


def trial(shape, backend, deterministic, timer, rounds):
    torch.use_deterministic_algorithms(deterministic)
    fn = make(shape)
    ctx = sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else None
    out = {"backend": backend, "deterministic": deterministic}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if ctx:
                ctx.__enter__()
            grads = [fn() for _ in range(3)]
            torch.cuda.synchronize()
            out["bit_identical_3_runs"] = all(torch.equal(grads[0], g) for g in grads[1:])
            out["max_abs_diff"] = max(float((grads[0].float() - g.float()).abs().max()) for g in grads[1:])
            del grads
            out["kernels"] = kernels_of(fn)
            torch.cuda.reset_peak_memory_stats()
            out["rounds_ms"] = []
            for _ in range(rounds):
                t = timer.time(fn)
                out["rounds_ms"].append({"median": pb.percentile(t, 50), "p10": pb.percentile(t, 10),
                                         "calls": len(t)})
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except RuntimeError as e:
            torch.cuda.synchronize()
            out["refused"] = str(e).splitlines()[0][:300]
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        out["warnings"] = sorted({str(w.message).strip()[:200] for w in caught})
    torch.use_deterministic_algorithms(False)
    torch.cuda.empty_cache()
    return out


def main():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    timer = pb.Timer(10, 50, 50.0, 20.0)
    doc = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "gpu": torch.cuda.get_device_name(), "results": []}
    for shard in ("llama31_405b_tp8", "gpt3_175b_tp4"):
        shape = pb.SHARDS[shard]["attention"]
        for backend in BACKENDS:
            for deterministic in (False, True):
                r = trial(shape, backend, deterministic, timer, rounds=3)
                r["shard"] = shard
                print(json.dumps(r), file=sys.stderr, flush=True)
                doc["results"].append(r)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
