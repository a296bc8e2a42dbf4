#!/usr/bin/env python3
"""pytorch_tp.py: the GPT-3 175B shard trained by PyTorch with Megatron's tensor parallelism over real
processes, one per GPU, as `mpiexec -n T replay-gpt3 --tp T` trains it: the baseline of replay's
multi-GPU runs (issue 27). Also `pytorch_baseline.py tp ...`.

    mpiexec -n 2 python3 scripts/pytorch_tp.py --preset 175b-tp4 --tp 2 --layers 2 --graphs full --json out.json
    torchrun --nproc-per-node 2 scripts/pytorch_tp.py --tp 2 ...   (the same flags)
        [--replay-bin DIR | --config FILE] [--steps 20] [--warmup 3] [--seed 1234]

The ranks: mpiexec's OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK (or PMI_RANK/PMI_SIZE, or torchrun's
RANK, WORLD_SIZE and LOCAL_RANK); the local rank picks the GPU; torch.distributed's NCCL backend carries
every collective, its rendezvous at MASTER_ADDR:MASTER_PORT (default 127.0.0.1:29533, one host; set them
for several). The world is one tensor-parallel group (--tp must equal the number of processes).

The shapes are replay's: `replay-gpt3 --preset P --tp T [--layers L] --print-config` (or --config FILE,
what it printed), the same shard replay's ranks compute. Split as replay splits it (workloads/transformer):
  - column-parallel QKV (this rank's heads) and FC1 (this rank's FFN columns): input replicated, the
    input gradient all-reduced in the backward;
  - row-parallel output projection and FC2: the partial outputs all-reduced in the forward, before the
    replicated bias and the residual add;
  - vocab-parallel token embedding (ids outside this rank's rows look up zeros, then an all-reduce) and
    tied LM head (the head's input gradient all-reduced);
  - vocab-parallel cross-entropy as Megatron's (all-reduces of the row max, of the target logit and of the
    sum of exponentials; replay all-gathers the three per-token statistics instead, the same small volume);
  - the gradient norm: each rank's sum of squares (replicated parameters counted once), all-reduced.
Per layer: 2 all-reduces of tokens x hidden bf16 forward and 2 backward (GPT-3 TP2: 48 MiB each).

Modes: --graphs none runs the step eagerly; --graphs full captures the whole step (forward, backward with
its collectives, norm, AdamW, masters -> bf16) in one torch.cuda.graph after --warmup eager steps on a side
stream. What that needs from PyTorch: the communicators created and every collective run eagerly first
(warm-up), capture_error_mode "thread_local" (torch's NCCL watchdog thread queries events while the main
thread captures; --capture-error-mode changes it), AdamW(capturable=True), and no host read of a device
value inside the step.

Output (rank 0): a progress line per mode and the workload-run JSON of pytorch_baseline.py (reports/
SCHEMA.md), with step_ms the slowest rank's series and a `parallel` block as replay's (world_size,
tensor_parallel, rank_step_ms, slowest_rank, collectives_per_step, comm_bytes_per_step).
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_baseline as pb  # noqa: E402  (no torch at import)

DEFAULT_PORT = 29533
# The variables by which a launcher tells a process its place (common/comm.cpp launched_by_mpi).
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "OPAL_")


def world_from_env(environ=None):
    """(rank, size, local_rank) from mpiexec's, PMI's or torchrun's variables; (0, 1, 0) when none."""
    env = os.environ if environ is None else environ
    for rank_key, size_key, local_key in (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
            ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        if env.get(rank_key) not in (None, "") and env.get(size_key) not in (None, ""):
            try:
                rank, size = int(env[rank_key]), int(env[size_key])
                local = int(env.get(local_key) or rank)
            except ValueError:
                raise pb.BaselineError(f"{rank_key}={env.get(rank_key)!r}, {size_key}={env.get(size_key)!r}: "
                                       f"not integers") from None
            return rank, size, local
    return 0, 1, 0


def tp_collectives_per_step(layers):
    """The step's all-reduces of tokens x hidden: the embedding, 2 per layer forward and 2 backward, the
    head's input gradient; then the 3 of the cross-entropy and the gradient norm's one (small)."""
    return 1 + 4 * layers + 1, 3 + 1


def tp_comm_bytes(cfg, layers):
    """Bytes of the large all-reduces in one step, as nccl-tests counts them (the buffer reduced)."""
    big, _ = tp_collectives_per_step(layers)
    tokens = cfg["micro_batch"] * cfg["seq"]
    small = 3 * tokens * 4 + 4
    return big * tokens * cfg["hidden"] * 2 + small


def shard_config_tp(args):
    """The TP shard's configuration: --config FILE, or replay-gpt3 --preset P --tp T [--layers L]
    --print-config."""
    if args.config is not None:
        cfg = pb.shard_config(pb.read_config_file(args.config), "gpt3", f"--config {args.config}")
        if args.preset is not None and args.preset != cfg["preset"]:
            raise pb.BaselineError(f"--preset {args.preset}: --config {args.config} is preset {cfg['preset']}")
    else:
        import json
        import subprocess
        bin_dir = args.replay_bin or pb.default_replay_bin()
        path = os.path.join(bin_dir, "replay-gpt3")
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise pb.BaselineError(f"no replay-gpt3 binary at {path}: build replay, or give --replay-bin DIR "
                                   f"or --config FILE (what `replay-gpt3 --preset P --tp T --print-config` printed)")
        flags = ["--preset", args.preset or "175b-tp4", "--tp", str(args.tp)]
        if args.layers is not None:
            flags += ["--layers", str(args.layers)]
        command = "replay-gpt3 " + " ".join(flags) + " --print-config"
        # Without the launcher's variables: under mpiexec the binary would take itself for this rank of
        # the launch, and only rank 0 prints its configuration.
        env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
        p = subprocess.run([path, *flags, "--print-config"], capture_output=True, text=True, timeout=120,
                           env=env)
        if p.returncode != 0:
            why = "; ".join(line.strip() for line in p.stderr.splitlines()[-3:] if line.strip())
            raise pb.BaselineError(f"`{command}` failed with exit status {p.returncode}: {why or 'no message'}")
        try:
            doc = json.loads(p.stdout)
        except ValueError as e:
            raise pb.BaselineError(f"`{command}` printed no JSON ({e}): stdout {p.stdout[:200]!r}, stderr "
                                   f"{p.stderr[-200:]!r}") from None
        cfg = pb.shard_config(doc, "gpt3", f"`{command}`")
    if cfg["tp"] != args.tp:
        raise pb.BaselineError(f"--tp {args.tp}: the configuration's shard is cut for tp {cfg['tp']}")
    return cfg


# ---------------------------------------------------------------------------------------------------------
# The model (torch): built on first use so that --help and the formulas need no torch
# ---------------------------------------------------------------------------------------------------------

def build_tp_model(cfg, layers, group, rank):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    class CopyToTP(torch.autograd.Function):
        """Identity forward; all-reduce of the gradient backward (the input of a column-parallel layer)."""
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g, group=group)
            return g

    class ReduceFromTP(torch.autograd.Function):
        """All-reduce forward (a row-parallel layer's partial output); identity backward."""
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class VocabParallelCE(torch.autograd.Function):
        """Megatron's vocab-parallel cross-entropy on this rank's logits [N, V/tp] (fp32): per-token loss."""
        @staticmethod
        def forward(ctx, logits, target, start, end):
            row_max = logits.max(dim=-1)[0]
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            logits = logits - row_max.unsqueeze(-1)
            outside = (target < start) | (target >= end)
            local = torch.where(outside, torch.zeros_like(target), target - start)
            picked = logits.gather(1, local.unsqueeze(1)).squeeze(1)
            picked = torch.where(outside, torch.zeros_like(picked), picked)
            dist.all_reduce(picked, group=group)
            exp = logits.exp_()
            sum_exp = exp.sum(dim=-1)
            dist.all_reduce(sum_exp, group=group)
            loss = torch.log(sum_exp) - picked
            exp.div_(sum_exp.unsqueeze(-1))
            ctx.save_for_backward(exp, outside, local)
            return loss

        @staticmethod
        def backward(ctx, g):
            softmax, outside, local = ctx.saved_tensors
            grad = softmax
            rows = torch.arange(grad.size(0), device=grad.device)
            grad[rows, local] -= (~outside).to(grad.dtype)
            grad.mul_(g.unsqueeze(-1))
            return grad, None, None, None

    h, heads, hd, ffn = cfg["hidden"], cfg["heads"], cfg["head_dim"], cfg["ffn"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * heads * hd)  # column-parallel: this rank's heads
            self.proj = nn.Linear(heads * hd, h, bias=False)  # row-parallel; its bias after the all-reduce
            self.proj_bias = nn.Parameter(torch.zeros(h))
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, ffn)  # column-parallel: this rank's FFN columns
            self.fc2 = nn.Linear(ffn, h, bias=False)  # row-parallel
            self.fc2_bias = nn.Parameter(torch.zeros(h))

        def forward(self, x):
            B, T, _ = x.shape
            a = CopyToTP.apply(self.ln1(x))
            q, k, v = self.qkv(a).view(B, T, 3, heads, hd).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = ReduceFromTP.apply(self.proj(y.transpose(1, 2).reshape(B, T, heads * hd)))
            x = x + y + self.proj_bias
            m = CopyToTP.apply(self.ln2(x))
            m = ReduceFromTP.apply(self.fc2(F.gelu(self.fc1(m), approximate="tanh")))
            return x + m + self.fc2_bias

    class GPT3TP(nn.Module):
        def __init__(self):
            super().__init__()
            self.start = rank * cfg["vocab_shard"]
            self.end = self.start + cfg["vocab_shard"]
            self.wte = nn.Embedding(cfg["vocab_shard"], h)  # this rank's rows; tied with the LM head
            self.wpe = nn.Embedding(cfg["seq"], h)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(h)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            for block in self.blocks:
                for residual in (block.proj, block.fc2):
                    nn.init.normal_(residual.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))

        def forward(self, idx, targets):
            T = idx.size(1)
            outside = (idx < self.start) | (idx >= self.end)
            local = torch.where(outside, torch.zeros_like(idx), idx - self.start)
            x = self.wte(local) * (~outside).unsqueeze(-1).to(self.wte.weight.dtype)
            x = ReduceFromTP.apply(x) + self.wpe(torch.arange(T, device=idx.device))
            for block in self.blocks:
                x = block(x)
            hf = CopyToTP.apply(self.ln_f(x))
            logits = F.linear(hf, self.wte.weight)  # [B, T, V/tp]
            loss = VocabParallelCE.apply(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                         self.start, self.end)
            return loss.mean()

    with torch.device("cuda"):
        return GPT3TP().to(torch.bfloat16)


def is_replicated(name):
    """The parameters every tensor-parallel rank holds whole (Megatron's, and replay's): the LayerNorms, the
    row-parallel layers' biases and the position table."""
    return any(part in name for part in ("ln1.", "ln2.", "ln_f.", "proj_bias", "fc2_bias", "wpe."))


def make_trainer(model, opt, group, rank):
    """pytorch_gpt3.MixedPrecisionTrainer with the tensor-parallel gradient norm: each rank's sum of
    squares over its shards and (rank 0 only) the replicated parameters, all-reduced, as one clip."""
    import torch
    import torch.distributed as dist
    from pytorch_gpt3 import MixedPrecisionTrainer

    class TPTrainer(MixedPrecisionTrainer):
        def __init__(self, model, opt):
            super().__init__(model, opt)
            self.replicated = [is_replicated(name) for name, _ in model.named_parameters()]
            self.counted = torch.tensor([1.0 if (not rep or rank == 0) else 0.0 for rep in self.replicated],
                                        dtype=torch.float32, device="cuda")

        def clip_gradients(self):
            # The global norm over the group: every rank's sum of squares, replicated tensors
            # counted on rank 0 only, all-reduced.
            grads = [m.grad for m in self.masters]
            norms = torch.stack(torch._foreach_norm(grads))
            sq = (norms * norms * self.counted).sum()
            dist.all_reduce(sq, group=group)
            grad_norm = sq.sqrt()
            coef = (self.opt["clip_norm"] / (grad_norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)
            return grad_norm

    return TPTrainer(model, opt)


def capture(trainer, static_tokens, mode):
    """The whole step in one torch.cuda.graph; returns (graph, (loss, norm), graphs_info)."""
    import torch
    try:
        graph, keep = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        graph, keep = torch.cuda.CUDAGraph(), False
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            outputs = trainer.step(static_tokens)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise pb.BaselineError(f"capturing the tensor-parallel step failed (capture_error_mode {mode}): "
                               f"{str(e).splitlines()[0]}") from e
    capture_ms = (time.perf_counter() - t0) * 1e3
    nodes = instantiate_ms = None
    if keep:
        nodes = pb.graph_node_count(graph.raw_cuda_graph())
        t0 = time.perf_counter()
        graph.instantiate()
        instantiate_ms = (time.perf_counter() - t0) * 1e3
    info = {"count": 1, "nodes": nodes, "capture_ms": capture_ms, "instantiate_ms": instantiate_ms,
            "capture_error_mode": mode}
    return graph, outputs, info


def run(args, cfg, layers, rank, size, local_rank):
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.master_port))
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    lead = rank == 0
    # The same seed on every rank: the replicated parameters (the position table) start equal, so the
    # replicated activations and the loss are the same on every rank (checked below).
    torch.manual_seed(args.seed)
    env, settings = pb.environment(), pb.torch_settings()
    env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    env["world_size"] = str(size)
    peak = pb.measure_gemm_peak(pb.Timer(5, 20))
    if lead:
        pb.progress(f"pytorch_tp gpt3 {cfg['preset']} tp {size}: torch {env['torch']}, NCCL {env['nccl']}, "
                    f"{env['gpu']}; graphs {args.graphs}, layers {layers}, hidden {cfg['hidden']}, heads "
                    f"{cfg['heads']}x{cfg['head_dim']} a rank, ffn {cfg['ffn']} a rank, seq {cfg['seq']}, "
                    f"micro-batch {cfg['micro_batch']}, vocab shard {cfg['vocab_shard']} of {cfg['vocab']}, "
                    f"{pb.model_params(cfg, layers) / 1e6:.1f}M parameters a rank; steps {args.steps}, "
                    f"warmup {args.warmup}; bf16 GEMM peak {peak:.1f} TFLOP/s")
    # Every rank trains on the same tokens: ids over the whole vocabulary (the embedding masks them).
    count = args.warmup + args.steps
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg["data_vocab"], (count, cfg["microbatches"], cfg["micro_batch"], cfg["seq"] + 1),
                           generator=g).pin_memory()
    model = build_tp_model(cfg, layers, group, rank)
    trainer = make_trainer(model, cfg["optimizer"], group, rank)
    static_tokens = torch.empty(tokens.shape[1:], dtype=tokens.dtype, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def load(i):
        static_tokens.copy_(tokens[i], non_blocking=True)

    static_loss = None  # the graph's loss output (--graphs full)
    graph, info = None, {"count": 0, "nodes": 0, "capture_ms": None, "instantiate_ms": None}
    if args.graphs == "full":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(args.warmup):
                load(i)
                trainer.step(static_tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph, (static_loss, _), info = capture(trainer, static_tokens, args.capture_error_mode)
        if lead:
            pb.progress(f"captured the step: {info['nodes']} nodes, capture {info['capture_ms']:.1f} ms, "
                        f"instantiate {pb.fmt_ms(info['instantiate_ms'])} ms")
    else:
        for i in range(args.warmup):
            load(i)
            trainer.step(static_tokens)
    torch.cuda.synchronize()
    dist.barrier(group=group)

    step_ms, host_us, losses = pb.timed_steps(args.steps, args.warmup, load, graph, static_loss, trainer,
                                              static_tokens)
    every = [None] * size
    dist.all_gather_object(every, step_ms, group=group)
    rank_losses = [None] * size
    dist.all_gather_object(rank_losses, losses.tolist(), group=group)
    medians = [pb.percentile(s, 50) for s in every]
    slowest = max(range(size), key=lambda r: medians[r])
    peak_bytes = torch.cuda.max_memory_allocated()
    memory = {"peak_bytes": peak_bytes, "reserved_bytes": torch.cuda.max_memory_reserved(),
              "arena_bytes": None, "graph_extra_bytes": None}
    doc = None
    if lead:
        measured = {"version": torch.__version__, "environment": env, "settings": settings,
                    "attention_backend": pb.model_backend(cfg), "memory": memory, "graphs_info": info,
                    "losses": losses.tolist(), "weights_hash": None,  # seconds of hashing: not needed here
                    "loss_floor": math.log(cfg["data_vocab"])}
        run_info = {"preset": cfg["preset"], "graphs": args.graphs, "seed": args.seed, "steps": args.steps,
                    "warmup": args.warmup, "data": "random"}
        doc = pb.workload_document(cfg, layers, run_info, every[slowest], host_us, peak, measured)
        big, small = tp_collectives_per_step(layers)
        doc["tensor_parallel_collectives"] = f"run (tp {size}, NCCL through torch.distributed)"
        doc["step_ms_rank"] = slowest
        doc["losses_identical_across_ranks"] = all(r == rank_losses[0] for r in rank_losses)
        doc["parallel"] = {"world_size": size, "tensor_parallel": size, "data_parallel": 1,
                           "rank_step_ms": medians, "slowest_rank": slowest,
                           "collectives_per_step": big + small,
                           "comm_bytes_per_step": tp_comm_bytes(cfg, layers)}
        s = doc["step_ms"]
        pb.progress(f"step {s['median']:.3f} ms median on the slowest rank ({slowest}; every rank: "
                    + ", ".join(f"{m:.3f}" for m in medians)
                    + f"), p10 {s['p10']:.3f}, p90 {s['p90']:.3f}; host enqueue "
                    f"{doc['host_enqueue_us']['median']:.0f} us; {doc['model_tflops']:.1f} TFLOP/s a GPU, "
                    f"MFU {doc['mfu']:.3f}; peak memory {peak_bytes / 2**30:.2f} GiB; loss "
                    f"{doc['losses'][0]:.4f} -> {doc['losses'][-1]:.4f} (ln V {math.log(cfg['data_vocab']):.4f}), "
                    f"the same on every rank: {doc['losses_identical_across_ranks']}")
        pb.write_json(args.json, doc)
        pb.progress(f"wrote {args.json}")
    dist.barrier(group=group)
    if graph is not None:
        del graph  # before the process group: a communicator held by a live graph would wait for it
    dist.destroy_process_group()
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="pytorch_tp.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--preset", default=None, help="replay-gpt3's preset (default 175b-tp4; with --config, the file's)")
    p.add_argument("--tp", type=pb._int_at_least(2), required=True,
                   help="tensor-parallel degree: the number of processes (mpiexec -n TP)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--replay-bin", metavar="DIR", default=None,
                        help=f"folder of replay's binaries ({pb.REPLAY_BIN_DEFAULT_HELP})")
    source.add_argument("--config", metavar="FILE", default=None,
                        help="what `replay-gpt3 --preset P --tp T [--layers L] --print-config` printed")
    p.add_argument("--graphs", choices=("none", "full"), default="none",
                   help="none: eager; full: the whole step, collectives and optimizer included, as one CUDA graph")
    p.add_argument("--layers", type=pb._int_at_least(1), default=None,
                   help="layers on each GPU (default: the configuration's, else what fits the state budget)")
    p.add_argument("--steps", type=pb._int_at_least(1), default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=pb._int_at_least(0), default=3,
                   help="untimed eager steps first (before the capture with --graphs full; default 3)")
    p.add_argument("--seed", type=pb._int_at_least(0), default=1234, help="weights and random tokens")
    p.add_argument("--capture-error-mode", choices=("thread_local", "global", "relaxed"), default="thread_local",
                   help="torch.cuda.graph's capture_error_mode (default thread_local: NCCL's watchdog thread "
                        "queries events during the capture)")
    p.add_argument("--master-port", type=pb._int_at_least(1), default=int(os.environ.get("MASTER_PORT", DEFAULT_PORT)),
                   help=f"rendezvous port when MASTER_PORT is not set (default {DEFAULT_PORT})")
    p.add_argument("--json", required=True, help="output JSON path (rank 0 writes it)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.graphs == "full" and args.warmup < 1:
            raise pb.BaselineError("--graphs full needs --warmup 1 or more: the communicators and the optimizer's "
                                   "state are created by the first step, which must not run inside the capture")
        out_dir = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(out_dir):
            raise pb.BaselineError(f"--json {args.json}: directory {out_dir} does not exist")
        rank, size, local_rank = world_from_env()
        if size != args.tp:
            raise pb.BaselineError(f"--tp {args.tp} needs {args.tp} processes, one per GPU (mpiexec -n {args.tp} or "
                                   f"torchrun --nproc-per-node {args.tp}); this launch has {size}")
        cfg = shard_config_tp(args)
        layers = args.layers if args.layers is not None else pb.default_layers(cfg)
        if layers > cfg["model_layers"]:
            raise pb.BaselineError(f"--layers {layers}: the model has {cfg['model_layers']} layers")
        torch = pb.require_cuda()
        if torch.cuda.device_count() <= local_rank:
            raise pb.BaselineError(f"local rank {local_rank} but {torch.cuda.device_count()} GPU(s) visible")
    except pb.BaselineError as e:
        print(f"pytorch_tp.py: error: {e}", file=sys.stderr)
        return 2
    try:
        return run(args, cfg, layers, rank, size, local_rank)
    except Exception as e:  # one rank's failure would leave the others in a collective: end the job
        import traceback
        traceback.print_exc()
        oom = type(e).__name__ == "OutOfMemoryError"
        print(f"pytorch_tp.py: error on rank {rank}: "
              + (f"out of GPU memory with {layers} layers; try a smaller --layers" if oom else str(e).splitlines()[0]
                 if str(e) else type(e).__name__), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
