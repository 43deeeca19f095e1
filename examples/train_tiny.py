"""Train a small decoder-only transformer twice, with torch's SDPA and with SageBwd attention.

The corpus is the Python standard library's own source, read byte by byte (vocabulary 256), so
the example needs no download.  Both runs start from the same weights and see the same batches
in the same order; only the attention function differs.  The model: RMSNorm, rotary position
embeddings, SwiGLU MLPs, optional QK-norm (``--qk-norm``).

    python examples/train_tiny.py                      # GPU, bfloat16, 300 steps
    python examples/train_tiny.py --device cpu --steps 3 --d-model 64 --layers 1 --seq-len 64

Prints both final losses, the largest gap between the smoothed loss curves and the step-time
ratio; saves the curves as a PNG (if matplotlib is installed) and as JSON beside it, at ``--out``
(default ``out/train_tiny.png`` under the current directory; the repository ignores ``out/``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

import sagebwd_cp.torch as sage

# ---------------------------------------------------------------------------------------- data


def read_stdlib_bytes(max_bytes: int) -> bytes:
    """The standard library's .py files, in sorted path order, concatenated up to ``max_bytes``."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise RuntimeError(f"no .py files found under the standard library path {root}")
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight.type_as(x)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0):
    """cos, sin of shape (seq_len, head_dim // 2), float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (B, N, H, D); rotates the two halves of the head dimension."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, qk_norm: bool, backend: str):
        super().__init__()
        self.heads, self.head_dim, self.backend = heads, d_model // heads, backend
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x, cos, sin):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).unbind(2)  # (B, N, H, D) each
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        q, k = q.type_as(v), k.type_as(v)
        if self.backend == "sdpa":
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            o = o.transpose(1, 2)
        else:
            o = sage.flash_attn_func(q, k, v, causal=True)  # NHD, no transposes
        return self.proj(o.reshape(b, n, d))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, qk_norm: bool, backend: str):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = Attention(d_model, heads, qk_norm, backend)
        hidden = 64 * math.ceil(8 * d_model / 3 / 64)
        self.mlp = SwiGLU(d_model, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, d_model: int, layers: int, heads: int, seq_len: int, qk_norm: bool, backend: str):
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, qk_norm, backend) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)
        cos, sin = rope_tables(seq_len, d_model // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:n], self.sin[:n])
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------------- training


class Progress:
    """tqdm when installed, else a plain line every few steps."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
        except ImportError:
            self.bar = None
            self.every = max(1, total // 20)

    def update(self, loss: float, ms: float):
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", ms=f"{ms:.1f}")
            self.bar.update(1)
        elif self.n % self.every == 0 or self.n == self.total:
            print(f"[{self.desc}] step {self.n}/{self.total}  loss {loss:.4f}  {ms:.1f} ms/step", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(backend: str, args, data: torch.Tensor, starts: torch.Tensor, device: torch.device, dtype: torch.dtype):
    """One training run; returns (losses, seconds per step)."""
    torch.manual_seed(args.seed)
    model = TinyLM(args.d_model, args.layers, args.heads, args.seq_len, args.qk_norm, backend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    autocast = dtype != torch.float32
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    offsets = torch.arange(args.seq_len + 1)
    losses, times = [], []
    progress = Progress(args.steps, backend)
    for step in range(args.steps):
        batch = data[starts[step][:, None] + offsets].to(device=device, dtype=torch.long, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        value = loss.item()  # synchronizes
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(value)
        progress.update(value, 1e3 * times[-1])
    progress.close()
    return losses, times


def smooth(values, beta: float = 0.9):
    """Bias-corrected exponential moving average."""
    out, avg = [], 0.0
    for i, x in enumerate(values):
        avg = beta * avg + (1 - beta) * x
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def save_plot(path: str, curves: dict, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path} (the curves are in the JSON file)")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, values in curves.items():
        line, = ax.plot(values, alpha=0.25, linewidth=0.8)
        ax.plot(smooth(values), color=line.get_color(), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="autocast dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--out", default=os.path.join("out", "train_tiny.png"),
                   help="PNG of the loss curves, the JSON written beside it (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--qk-norm", action="store_true", help="RMSNorm on queries and keys before RoPE")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="how much of the standard library to read")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.d_model % args.heads or (args.d_model // args.heads) % 8 or args.d_model // args.heads > 128:
        p.error("--d-model / --heads (the head dimension) must be a multiple of 8, at most 128")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    corpus = read_stdlib_bytes(int(args.corpus_mb * 2**20))
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    if len(data) <= args.seq_len + 1:
        raise SystemExit(f"corpus too small ({len(data)} bytes) for --seq-len {args.seq_len}")
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(data) - args.seq_len - 1, (args.steps, args.batch_size), generator=g)
    print(f"corpus: {len(data) / 2**20:.2f} MiB of standard-library source; device {device}, {dtype}; "
          f"d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq {args.seq_len}, "
          f"batch {args.batch_size}, {args.steps} steps{', QK-norm' if args.qk_norm else ''}")

    runs = {}
    for backend in ("sdpa", "sage"):
        runs[backend] = train(backend, args, data, starts, device, dtype)
    (l_ref, t_ref), (l_sage, t_sage) = runs["sdpa"], runs["sage"]
    skip = min(len(t_ref) - 1, max(1, args.steps // 10))  # first steps include compilation and warm-up
    ms_ref, ms_sage = 1e3 * statistics.median(t_ref[skip:]), 1e3 * statistics.median(t_sage[skip:])
    gap = max(abs(a - b) for a, b in zip(smooth(l_ref), smooth(l_sage)))
    summary = {"final_loss_sdpa": l_ref[-1], "final_loss_sage": l_sage[-1], "max_smoothed_gap": gap,
               "step_time_ratio": ms_sage / ms_ref, "median_ms_per_step_sdpa": ms_ref,
               "median_ms_per_step_sage": ms_sage}
    print(f"final loss: sdpa {l_ref[-1]:.4f}, sage {l_sage[-1]:.4f}")
    print(f"max gap between the smoothed curves: {gap:.4f}")
    print(f"step time sage / sdpa: {ms_sage / ms_ref:.2f} (median {ms_sage:.1f} ms vs {ms_ref:.1f} ms per step)")

    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.splitext(args.out)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump({"args": vars(args), "summary": summary, "loss_sdpa": l_ref, "loss_sage": l_sage}, f)
    title = f"byte-level LM on the stdlib, {device.type} {str(dtype).replace('torch.', '')}"
    if save_plot(args.out, {"torch SDPA": l_ref, "SageBwd": l_sage}, title):
        print(f"saved {args.out}")
    print(f"saved {json_path}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
