#!/usr/bin/env python3
"""pytorch_unet.py: the PyTorch baseline of replay-unet (issue 28): one training step of the
Stable Diffusion v2 UNet the way users train it, timed like replay's driver.

The model is diffusers' UNet2DConditionModel built from SD 2's configuration with 16 GroupNorm
groups where diffusers can be imported (--model diffusers; `scripts/setup.sh --bundle` stages
diffusers 0.42.1 in .deps/python, which the script adds to its path when diffusers is not installed),
else a PyTorch UNet of the same architecture written here (--model torch: the same modules, the same
parameter names and count, 865,910,724). The JSON's "model" says which ran ("diffusers" with its
"model_version", or "torch"). The step: latents sampled from VAE moments (x 0.18215), a timestep and Gaussian noise
per sample, the DDPM schedule (1000 steps, scaled-linear beta 0.00085 to 0.012), v-prediction, MSE;
channels-last, fp16 autocast with GradScaler, SDPA attention, fused AdamW (0.9, 0.999, 1e-8, weight
decay 0.01).

--graphs none: eager steps. --graphs full: the whole step (forward, backward, GradScaler's
unscale and found-inf, the fused AdamW step and the scale update) captured once in
torch.cuda.graph after warm-up on a side stream and replayed. What that needs: the fused AdamW
with capturable=True (step counter and learning rate on the device), GradScaler with a fused
optimizer (no found_inf.item()), gradients zeroed in place (set_to_none=False), static input
tensors refilled outside the graph. Prints one line per run and writes a JSON summary.
"""
import argparse
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None):
    p = argparse.ArgumentParser(prog="pytorch_unet.py", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32, help="images per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (and capture)")
    p.add_argument("--graphs", choices=["none", "full"], default="none")
    p.add_argument("--model", choices=["auto", "diffusers", "torch"], default="auto")
    p.add_argument("--groups", type=int, default=16, help="GroupNorm groups")
    p.add_argument("--latent", type=int, default=64, help="latent height and width")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="write the summary here")
    p.add_argument("--count-only", action="store_true", help="print the parameter count and exit")
    a = p.parse_args(argv)
    # Checked before torch is imported: bad flags fail at once.
    if a.batch < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--batch and --steps must be at least 1, --warmup at least 0")
    if a.latent < 8 or a.latent % 8:
        p.error(f"--latent {a.latent}: the UNet downsamples three times, so a multiple of 8 is needed")
    if a.groups < 1 or 320 % a.groups:
        p.error(f"--groups {a.groups}: GroupNorm groups must divide the 320 channels of the first level")
    return a


def build_torch_unet(torch, groups):
    nn = torch.nn
    F = torch.nn.functional

    class Timesteps(nn.Module):
        def __init__(self, ch):
            super().__init__()
            self.ch = ch

        def forward(self, t):
            half = self.ch // 2
            exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device)
            emb = t[:, None].float() * torch.exp(exponent / half)[None, :]
            return torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1)  # flip_sin_to_cos

    class TimestepEmbedding(nn.Module):
        def __init__(self, cin, dim):
            super().__init__()
            self.linear_1 = nn.Linear(cin, dim)
            self.linear_2 = nn.Linear(dim, dim)

        def forward(self, x):
            return self.linear_2(F.silu(self.linear_1(x)))

    class Resnet(nn.Module):
        def __init__(self, cin, cout, temb):
            super().__init__()
            self.norm1 = nn.GroupNorm(groups, cin, eps=1e-5)
            self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
            self.time_emb_proj = nn.Linear(temb, cout)
            self.norm2 = nn.GroupNorm(groups, cout, eps=1e-5)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
            self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

        def forward(self, x, temb):
            h = self.conv1(F.silu(self.norm1(x)))
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
            h = self.conv2(F.silu(self.norm2(h)))
            return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h

    class Attention(nn.Module):
        def __init__(self, dim, heads, ctx_dim=None):
            super().__init__()
            self.heads = heads
            self.to_q = nn.Linear(dim, dim, bias=False)
            self.to_k = nn.Linear(ctx_dim or dim, dim, bias=False)
            self.to_v = nn.Linear(ctx_dim or dim, dim, bias=False)
            self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

        def forward(self, x, ctx=None):
            ctx = x if ctx is None else ctx
            b, s, c = x.shape
            q = self.to_q(x).view(b, s, self.heads, -1).transpose(1, 2)
            k = self.to_k(ctx).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2)
            v = self.to_v(ctx).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v)
            return self.to_out[0](o.transpose(1, 2).reshape(b, s, c))

    class GEGLU(nn.Module):
        def __init__(self, dim, inner):
            super().__init__()
            self.proj = nn.Linear(dim, inner * 2)

        def forward(self, x):
            a, gate = self.proj(x).chunk(2, dim=-1)
            return a * F.gelu(gate)

    class FeedForward(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.net = nn.ModuleList([GEGLU(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim)])

        def forward(self, x):
            for m in self.net:
                x = m(x)
            return x

    class BasicTransformerBlock(nn.Module):
        def __init__(self, dim, heads, ctx_dim):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.attn1 = Attention(dim, heads)
            self.norm2 = nn.LayerNorm(dim)
            self.attn2 = Attention(dim, heads, ctx_dim)
            self.norm3 = nn.LayerNorm(dim)
            self.ff = FeedForward(dim)

        def forward(self, x, ctx):
            x = self.attn1(self.norm1(x)) + x
            x = self.attn2(self.norm2(x), ctx) + x
            return self.ff(self.norm3(x)) + x

    class Transformer2D(nn.Module):
        def __init__(self, dim, heads, ctx_dim):
            super().__init__()
            self.norm = nn.GroupNorm(groups, dim, eps=1e-6)
            self.proj_in = nn.Linear(dim, dim)
            self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(dim, heads, ctx_dim)])
            self.proj_out = nn.Linear(dim, dim)

        def forward(self, x, ctx):
            b, c, h, w = x.shape
            r = x
            x = self.norm(x).permute(0, 2, 3, 1).reshape(b, h * w, c)
            x = self.proj_in(x)
            for blk in self.transformer_blocks:
                x = blk(x, ctx)
            x = self.proj_out(x).reshape(b, h, w, c).permute(0, 3, 1, 2)
            return x + r

    class Down(nn.Module):
        def __init__(self, cin, cout, temb, attn, down, heads, ctx_dim):
            super().__init__()
            self.resnets = nn.ModuleList([Resnet(cin if i == 0 else cout, cout, temb) for i in range(2)])
            self.attentions = nn.ModuleList([Transformer2D(cout, heads, ctx_dim) for _ in range(2)]) if attn else None
            self.downsamplers = nn.ModuleList([DownConv(cout)]) if down else None

        def forward(self, x, temb, ctx):
            skips = []
            for i, r in enumerate(self.resnets):
                x = r(x, temb)
                if self.attentions is not None:
                    x = self.attentions[i](x, ctx)
                skips.append(x)
            if self.downsamplers is not None:
                x = self.downsamplers[0](x)
                skips.append(x)
            return x, skips

    class DownConv(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, stride=2, padding=1)

        def forward(self, x):
            return self.conv(x)

    class UpConv(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))

    class Up(nn.Module):
        def __init__(self, cin_prev, cout, skip_chs, temb, attn, up, heads, ctx_dim):
            super().__init__()
            chs = [cin_prev] + [cout] * 2
            self.resnets = nn.ModuleList([Resnet(chs[i] + skip_chs[i], cout, temb) for i in range(3)])
            self.attentions = nn.ModuleList([Transformer2D(cout, heads, ctx_dim) for _ in range(3)]) if attn else None
            self.upsamplers = nn.ModuleList([UpConv(cout)]) if up else None

        def forward(self, x, skips, temb, ctx):
            for i, r in enumerate(self.resnets):
                x = r(torch.cat([x, skips.pop()], dim=1), temb)
                if self.attentions is not None:
                    x = self.attentions[i](x, ctx)
            if self.upsamplers is not None:
                x = self.upsamplers[0](x)
            return x

    class Mid(nn.Module):
        def __init__(self, c, temb, heads, ctx_dim):
            super().__init__()
            self.resnets = nn.ModuleList([Resnet(c, c, temb), Resnet(c, c, temb)])
            self.attentions = nn.ModuleList([Transformer2D(c, heads, ctx_dim)])

        def forward(self, x, temb, ctx):
            x = self.resnets[0](x, temb)
            x = self.attentions[0](x, ctx)
            return self.resnets[1](x, temb)

    class UNet(nn.Module):
        def __init__(self, base=320, mult=(1, 2, 4, 4), attn=(True, True, True, False), ctx_dim=1024):
            super().__init__()
            chs = [base * m for m in mult]
            temb = 4 * base
            self.time_proj = Timesteps(base)
            self.time_embedding = TimestepEmbedding(base, temb)
            self.conv_in = nn.Conv2d(4, base, 3, padding=1)
            self.down_blocks = nn.ModuleList()
            skip = [base]
            cin = base
            for i, c in enumerate(chs):
                last = i == len(chs) - 1
                self.down_blocks.append(Down(cin, c, temb, attn[i], not last, c // 64, ctx_dim))
                skip += [c, c] + ([] if last else [c])
                cin = c
            self.mid_block = Mid(chs[-1], temb, chs[-1] // 64, ctx_dim)
            self.up_blocks = nn.ModuleList()
            prev = chs[-1]
            for u in range(len(chs)):
                lvl = len(chs) - 1 - u
                sk = [skip.pop() for _ in range(3)]
                self.up_blocks.append(Up(prev, chs[lvl], sk, temb, attn[lvl], u + 1 < len(chs), chs[lvl] // 64, ctx_dim))
                prev = chs[lvl]
            self.conv_norm_out = nn.GroupNorm(groups, base, eps=1e-5)
            self.conv_out = nn.Conv2d(base, 4, 3, padding=1)

        def forward(self, x, t, ctx):
            temb = self.time_embedding(self.time_proj(t).to(x.dtype))
            x = self.conv_in(x)
            skips = [x]
            for d in self.down_blocks:
                x, s = d(x, temb, ctx)
                skips += s
            x = self.mid_block(x, temb, ctx)
            for u in self.up_blocks:
                x = u(x, skips, temb, ctx)
            return self.conv_out(F.silu(self.conv_norm_out(x)))

    return UNet()


def import_diffusers():
    """diffusers, from the installed packages or else from the repository's .deps/python (staged by
    scripts/setup.sh --bundle: the GPU machine has no diffusers of its own)."""
    try:
        import diffusers
    except ImportError:
        deps = os.path.join(REPO, ".deps", "python")
        if not os.path.isdir(os.path.join(deps, "diffusers")) or deps in sys.path:
            raise
        sys.path.append(deps)  # after the installed packages: theirs win where both have one
        import diffusers
    return diffusers


def build_diffusers_unet(groups):
    from diffusers import UNet2DConditionModel  # noqa: import only when asked for

    m = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, cross_attention_dim=1024,
        attention_head_dim=(5, 10, 20, 20), use_linear_projection=True, norm_num_groups=groups)
    return m


def main(argv=None):
    args = parse(argv)
    import torch

    torch.manual_seed(args.seed)
    name = "torch"
    version = torch.__version__
    model = None
    if args.model in ("auto", "diffusers"):
        try:
            version = import_diffusers().__version__
            model = build_diffusers_unet(args.groups)
            name = "diffusers"
        except Exception as e:  # not importable here
            if args.model == "diffusers":
                sys.exit(f"pytorch_unet: diffusers cannot be imported: {e}")
            print(f"pytorch_unet: diffusers not importable ({type(e).__name__}: {e}); "
                  "using the PyTorch UNet of the same architecture")
    if model is None:
        version = torch.__version__
        model = build_torch_unet(torch, args.groups)
    params = sum(p.numel() for p in model.parameters())
    if args.count_only:
        print(params)
        print(f"# model: {name} {version}", file=sys.stderr)
        return
    if not torch.cuda.is_available():
        sys.exit("pytorch_unet: no CUDA device")
    dev = torch.device("cuda")
    model = model.to(dev).to(memory_format=torch.channels_last)
    B, H = args.batch, args.latent
    # The DDPM schedule (scaled linear), as replay's diffusion.h.
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    acp = torch.cumprod(1 - betas, 0)
    sqrt_a = acp.sqrt().float().to(dev)
    sqrt_b = (1 - acp).sqrt().float().to(dev)
    # Static inputs (refilled outside the graph): the batch's moments and context.
    g = torch.Generator(device=dev).manual_seed(args.seed)
    moments = torch.randn(B, 8, H, H, device=dev, generator=g).half()
    context = torch.randn(B, 77, 1024, device=dev, generator=g).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1.25e-7 * B, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, fused=True, capturable=args.graphs == "full")
    scaler = torch.amp.GradScaler("cuda", init_scale=65536.0, growth_interval=2000)
    loss_out = torch.zeros((), device=dev)

    def step():
        mean, logvar = moments.float().chunk(2, dim=1)
        latent = (mean + torch.exp(0.5 * logvar.clamp(-30, 20)) * torch.randn_like(mean)) * 0.18215
        t = torch.randint(0, 1000, (B,), device=dev)
        noise = torch.randn_like(latent)
        a, b = sqrt_a[t][:, None, None, None], sqrt_b[t][:, None, None, None]
        noisy = (a * latent + b * noise).contiguous(memory_format=torch.channels_last)
        target = a * noise - b * latent
        # The autocast cache would keep casts made during capture alive across replays: off.
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=args.graphs != "full"):
            out = model(noisy, t, context)
            pred = out.sample if hasattr(out, "sample") else out
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        opt.zero_grad(set_to_none=False)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        loss_out.copy_(loss.detach())

    graph_note = ""
    torch.cuda.reset_peak_memory_stats()  # warm-up and capture included: the graph's pool counts
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(args.warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = None
    capture_ms = 0.0
    if args.graphs == "full":
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - t0) * 1e3
        graph_note = ("whole step in one torch.cuda.graph: fused AdamW capturable=True, GradScaler "
                      "with the fused optimizer (no found_inf sync), zero_grad(set_to_none=False)")
    run = graph.replay if graph is not None else step
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
    host_us, losses = [], []
    for k in range(args.steps):
        starts[k].record()
        h0 = time.perf_counter()
        run()
        host_us.append((time.perf_counter() - h0) * 1e6)
        ends[k].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    med = ms[len(ms) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30
    host = sorted(host_us)[len(host_us) // 2]
    line = (f"pytorch_unet {name} {version} batch {B} graphs {args.graphs}: torch {torch.__version__}, "
            f"{torch.cuda.get_device_name()}, {params} parameters; step {med:.3f} ms median "
            f"(p10 {ms[len(ms) // 10]:.3f}, p90 {ms[min(len(ms) - 1, len(ms) * 9 // 10)]:.3f}), "
            f"{B / med * 1e3:.1f} images/s, host enqueue {host:.0f} us, peak memory {peak:.2f} GiB, "
            f"loss {loss_out.item():.4f}, scale {scaler.get_scale():g}")
    print(line)
    if graph_note:
        print("# " + graph_note + f"; capture {capture_ms:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            # replay-unet's preset of the same shape, so that report.py's tables name it.
            preset = {32: "sd2-b32", 64: "sd2-b64"}.get(B) if H == 64 else None
            json.dump({"tool": "pytorch_unet", "workload": "unet", **({"preset": preset} if preset else {}),
                       "model": name, "model_version": version,
                       "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "batch": B, "graphs": args.graphs,
                       "parameters": params, "groups": args.groups, "steps": args.steps,
                       "step_ms": {"median": med, "p10": ms[len(ms) // 10],
                                   "p90": ms[min(len(ms) - 1, len(ms) * 9 // 10)], "all": ms},
                       "images_per_s": B / med * 1e3,
                       "throughput": {"images_per_s": B / med * 1e3, "samples_per_s": B / med * 1e3},
                       "host_enqueue_us": {"median": host,
                                           "p90": sorted(host_us)[min(len(host_us) - 1,
                                                                      len(host_us) * 9 // 10)]},
                       "memory": {"peak_bytes": torch.cuda.max_memory_allocated()},
                       "peak_memory_gib": peak, "capture_ms": capture_ms, "graph_note": graph_note,
                       "loss": loss_out.item()}, f, indent=1)


if __name__ == "__main__":
    main()
