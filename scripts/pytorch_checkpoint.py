"""pytorch_checkpoint.py: replay's checkpoints (train/checkpoint.h) in the PyTorch baselines. A checkpoint
is a safetensors file: the model weights under replay's parameter names, fp32 master weights and Adam's
moments under optimizer.*, the step counters under train.*, the data cursor, and the resolved
configuration (what `--print-config` prints) in its metadata. This module maps replay's names onto the
baseline modules (pytorch_gpt3.GPT3Shard, pytorch_llama31.Llama31Shard), loads a checkpoint into a model
and its MixedPrecisionTrainer, and compares one step's loss and gradients with what replay wrote
(`--dump-step`): `pytorch_baseline.py gradcheck`.

Imported by pytorch_baseline.py only to run; imports torch and safetensors.
"""

import json
import math
import re

import torch

from pytorch_baseline import BaselineError, shard_config

# replay's parameter names (workloads/transformer/model.cpp) -> the baseline modules' names.
_FIXED = {
    "gpt3": {"embedding.token": "wte.weight", "embedding.position": "wpe.weight",
             "final_norm.weight": "ln_f.weight", "final_norm.bias": "ln_f.bias"},
    "llama31": {"embedding.token": "embed.weight", "final_norm.weight": "norm_f.weight",
                "lm_head.weight": "lm_head.weight"},
}
_LAYER = re.compile(r"layer(\d+)\.(ln1|ln2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)")
_PART = {
    "gpt3": {"ln1": "ln1", "ln2": "ln2", "attn.qkv": "qkv", "attn.proj": "proj", "mlp.fc1": "fc1",
             "mlp.fc2": "fc2"},
    "llama31": {"ln1": "norm1", "ln2": "norm2", "attn.qkv": "qkv", "attn.proj": "proj", "mlp.fc1": "fc1",
                "mlp.fc2": "fc2"},
}

# Gradient agreement, one step of the tiny preset: replay (bf16 activations, fp32 accumulation) and the
# baseline in bf16 each differ from the same step computed in fp32 from the same bf16 weights. A tensor
# passes when replay's relative L2 error against fp32 is at most GRAD_REL_FACTOR times the baseline's own
# bf16 error, or GRAD_REL_FLOOR, whichever is larger; the loss when it is within LOSS_ABS of fp32's.
GRAD_REL_FACTOR = 2.0
GRAD_REL_FLOOR = 0.02
LOSS_ABS = 2e-3


def torch_name(workload, name):
    """The baseline module's parameter name of replay parameter `name`."""
    fixed = _FIXED[workload]
    if name in fixed:
        return fixed[name]
    m = _LAYER.fullmatch(name)
    if not m:
        raise BaselineError(f"replay parameter {name!r} has no counterpart in the {workload} baseline")
    return f"blocks.{m.group(1)}.{_PART[workload][m.group(2)]}.{m.group(3)}"


def read_checkpoint(path, workload):
    """(tensors on the CPU, metadata, shard config) of a replay checkpoint of `workload`."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise BaselineError(f"reading a replay checkpoint needs the safetensors package ({e})") from None
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, RuntimeError, ValueError) as e:
        raise BaselineError(f"{path}: cannot read as safetensors: {e}") from None
    if meta.get("format") != "replay-checkpoint":
        raise BaselineError(f"{path}: not a replay checkpoint (metadata format {meta.get('format')!r})")
    if meta.get("workload") != workload:
        raise BaselineError(f"{path}: a checkpoint of {meta.get('workload')!r}, not {workload!r}")
    try:
        doc = json.loads(meta["config"])
    except (KeyError, ValueError) as e:
        raise BaselineError(f"{path}: no readable configuration in its metadata ({e})") from None
    return tensors, meta, shard_config(doc, workload, f"{path}'s configuration")


def replay_params(tensors):
    """replay's parameter names, in its order: the tensors that have an optimizer.master copy."""
    prefix = "optimizer.master."
    return [k[len(prefix):] for k in tensors if k.startswith(prefix)]


def load_weights(model, tensors, workload, source):
    """Copies replay's weights into `model` (every parameter must be there, with its shape)."""
    params = dict(model.named_parameters())
    names = replay_params(tensors)
    seen = set()
    for name in names:
        tname = torch_name(workload, name)
        if tname not in params:
            raise BaselineError(f"{source}: {name!r} maps to {tname!r}, which the baseline model lacks")
        p, t = params[tname], tensors[name]
        if tuple(p.shape) != tuple(t.shape):
            raise BaselineError(f"{source}: {name!r} is {list(t.shape)}, the baseline's {tname} is "
                                f"{list(p.shape)}")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        seen.add(tname)
    missing = sorted(set(params) - seen)
    if missing:
        raise BaselineError(f"{source}: no weights for {', '.join(missing)}")
    return names


def load_trainer_state(trainer, model, tensors, workload):
    """The fp32 master weights, Adam's moments and step counters of a checkpoint, into a
    pytorch_gpt3.MixedPrecisionTrainer built on `model`: the next step continues replay's run."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    step = int(tensors["train.step"].item())
    for name in replay_params(tensors):
        i = index[torch_name(workload, name)]
        master = trainer.masters[i]
        with torch.no_grad():
            master.copy_(tensors["optimizer.master." + name])
            trainer.params[i].copy_(master)
        # torch's capturable AdamW keeps the step count as a float32 device tensor per parameter.
        trainer.optimizer.state[master] = {
            "step": torch.tensor(float(step), dtype=torch.float32, device=master.device),
            "exp_avg": tensors["optimizer.exp_avg." + name].to(master.device).clone(),
            "exp_avg_sq": tensors["optimizer.exp_avg_sq." + name].to(master.device).clone(),
        }
    trainer.step_count.fill_(float(step))
    return step


def _rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def gradcheck(workload, checkpoint, step_path, build_model):
    """One step of replay (`--load CHECKPOINT --steps 1 --dump-step STEP`) against the baseline on the same
    weights and batch: the loss and every gradient, in bf16 (as the baseline trains) and in fp32 (the
    reference both are measured against). Returns the JSON document; its "pass" says whether every
    tensor is within the tolerance above."""
    from safetensors.torch import load_file
    tensors, meta, cfg = read_checkpoint(checkpoint, workload)
    if float(json.loads(meta["config"])["config"].get("dropout", 0)) != 0:
        raise BaselineError(f"{checkpoint}: trained with dropout; the cross-check needs --dropout 0")
    step = load_file(step_path)
    layers = cfg["layers"]
    model = build_model(cfg, layers)
    names = load_weights(model, tensors, workload, checkpoint)
    n = cfg["microbatches"]
    batches = [(step[f"batch.tokens.{i}"].long().cuda() % cfg["vocab_shard"],
                step[f"batch.targets.{i}"].long().cuda() % cfg["vocab_shard"]) for i in range(n)]

    def run(m):
        m.zero_grad(set_to_none=True)
        loss = 0.0
        for tokens, targets in batches:
            mb = m(tokens, targets) / n
            mb.backward()
            loss += mb.item()
        return loss, {k: p.grad.float() for k, p in m.named_parameters()}

    loss16, grads16 = run(model)
    model32 = model.float()
    loss32, grads32 = run(model32)
    loss_replay = step["loss"].item()
    rows, ok = [], abs(loss_replay - loss32) <= LOSS_ABS
    for name in names:
        tname = torch_name(workload, name)
        g32, g16 = grads32[tname], grads16[tname]
        gr = step["grad." + name].cuda()
        rel_replay, rel_torch = _rel(gr, g32), _rel(g16, g32)
        limit = max(GRAD_REL_FACTOR * rel_torch, GRAD_REL_FLOOR)
        passed = math.isfinite(rel_replay) and rel_replay <= limit
        ok = ok and passed
        rows.append({"name": name, "torch_name": tname, "rel_err_replay": rel_replay,
                     "rel_err_torch_bf16": rel_torch, "limit": limit, "pass": passed})
    return {"workload": workload, "preset": cfg["preset"], "checkpoint": checkpoint, "step": step_path,
            "loss": {"replay": loss_replay, "torch_bf16": loss16, "torch_fp32": loss32, "limit": LOSS_ABS},
            "tolerance": {"grad_rel_factor": GRAD_REL_FACTOR, "grad_rel_floor": GRAD_REL_FLOOR,
                          "reference": "the same step in fp32 from the same bf16 weights"},
            "tensors": rows, "pass": ok}
