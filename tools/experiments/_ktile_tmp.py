import os, statistics, torch
import sagebwd_cp
def timed(fn, reps=15):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps): fn()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / reps
out = []
for shape, w in (("2x16x4x8192x128", 1024), ("2x16x4x8192x128", 2048), ("8x16x4x2048x128", 512), ("2x16x4x4096x128", 1024),
                 ("2x32x8x8192x64", 1024), ("8x32x8x2048x64", 512), ("2x32x8x8192x64", 2048)):
    b, hq, hk, n, d = map(int, shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, device="cuda").bfloat16() for h in (hq, hk, hk))
    do = torch.randn_like(q)
    kw = dict(causal=True, window_size=(w, 0))
    def fb():
        _, saved = sagebwd_cp.attention_forward(q, k, v, **kw)
        sagebwd_cp.attention_backward(saved, do)
    f = statistics.median(timed(lambda: sagebwd_cp.attention(q, k, v, **kw)) for _ in range(3))
    t = statistics.median(timed(fb) for _ in range(3))
    out.append(f"{shape} w{w}: {f:.4f}/{t:.4f}")
print(os.environ.get("SAGEBWD_FORWARD_KEY_TILE", "new"), " | ".join(out), flush=True)
