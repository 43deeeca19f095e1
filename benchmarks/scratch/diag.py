import numpy as np, torch, sys
sys.path.insert(0, "tests")
import sagebwd_cp
from gpu_helpers import make_qkv, to_hnd_numpy, rel_l2
from sagebwd_cp import emulator, reference
for causal in (False, True):
  for hq, hk, lq, lk in ((4,2,333,300),(2,2,256,256),(4,4,333,300)):
    q, k, v = make_qkv(1, hq, hk, lq, lk, 64, "float16", "HND", seed=5)
    k = k + 2.0 * (torch.arange(64, device="cuda") % 5 == 0).to(k.dtype)
    out, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, smooth_q=True)
    torch.cuda.synchronize()
    qh, kh, vh = (to_hnd_numpy(x, "HND") for x in (q, k, v))
    o, lse, st = emulator.emulate_forward(qh, kh, vh, causal=causal, smooth_q=True)
    l2 = saved.lse2.obj.cpu().numpy(); le = st["lse2"][:, :, :lq]
    fin = np.isfinite(le)
    print(causal, hq, hk, lq, lk, "O", rel_l2(out.float().cpu().numpy(), o), "lse2 maxdiff", float(np.abs(l2[fin]-le[fin]).max()))
