"""GPU side of the mma.sync performance model (tools/perf_model): one calibration run on a Hopper card.

Measures, with ``SAGEBWD_WGMMA=0`` (the mma.sync kernels), per shape (fp16, 16K tokens a batch,
hidden 2048, head dim 64 and 128, causal and not, N = 2K..16K):
  - our forward and backward: the call, and each launch inside it (CUDA events around every
    launch of the plan, as tools/probe_steps.py does), with each launch's grid, block and shared memory;
  - FlashAttention-2 through SDPA's flash backend: the call (events), and each kernel's GPU time
    (torch's profiler);
and the machine's figures the model needs: SM count, the SM clock under load (clock64 against the
global timer), the mma.sync INT8 and fp16 ceilings (kernels/ceiling.cu), nvidia-smi's clocks; then,
where ncu is usable, per-kernel instruction counts and issue activity at 4K (checks of the SASS counts).

Writes ``calibration.json`` under --out after every section (a partial run still leaves what it
measured), and ``ncu_*.csv`` with ncu's raw output. One run, a few minutes:

    python tools/perf_model/calibrate.py --out "$OUT"

The CPU side reads it back: ``python -m tools.perf_model fit --calibration "$OUT/calibration.json"``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

os.environ["SAGEBWD_WGMMA"] = "0"  # the mma.sync kernels on Hopper too (specs.use_wgmma reads it per call)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tools"), os.path.join(ROOT, "benchmarks")]

SCHEMA = 1
HIDDEN, TOKENS = 2048, 16384
NCU_CONFIGS = ((128, False, 4096), (64, False, 4096), (128, True, 4096), (64, True, 4096))
NCU_BASE_METRICS = ("gpu__time_duration.sum", "smsp__inst_executed.sum", "sm__cycles_elapsed.avg.per_second",
                    "smsp__issue_active.avg.pct_of_peak_sustained_active",
                    "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
                    "launch__grid_size", "launch__block_size")
NCU_PIPE_METRICS = ("sm__inst_executed_pipe_alu.sum", "sm__inst_executed_pipe_fma.sum", "sm__inst_executed_pipe_xu.sum",
                    "sm__inst_executed_pipe_lsu.sum", "sm__inst_executed_pipe_tensor_op_hmma.sum",
                    "sm__inst_executed_pipe_tensor_op_imma.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
                    "smsp__cycles_active.avg")

CLOCK_SRC = r"""
extern "C" __global__ void perfmodel_clock(long long iters, unsigned long long* out) {
    unsigned long long t0, t1;
    const long long c0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    float x = threadIdx.x * 1e-3f;
    for (long long i = 0; i < iters; ++i) x = fmaf(x, 0.9999f, 1e-4f);
    const long long c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0) {
        out[3 * blockIdx.x] = c1 - c0;
        out[3 * blockIdx.x + 1] = t1 - t0;
        out[3 * blockIdx.x + 2] = __float_as_uint(x);
    }
}
extern "C" __global__ void perfmodel_marker(int* p) { if (p) p[blockIdx.x] = blockIdx.x; }
"""


def _cupy_module():
    import cupy

    return cupy.RawModule(code=CLOCK_SRC)


def measure_clock(sms: int, iters: int = 40_000_000) -> dict:
    """SM clock (MHz) while every SM runs an FMA chain: clock64 cycles over global-timer ns, per block."""
    import cupy

    fn = _cupy_module().get_function("perfmodel_clock")
    out = cupy.zeros(3 * sms, dtype=cupy.uint64)
    fn((sms,), (128,), (cupy.int64(iters // 10), out))  # warm-up
    cupy.cuda.runtime.deviceSynchronize()
    fn((sms,), (128,), (cupy.int64(iters), out))
    cupy.cuda.runtime.deviceSynchronize()
    v = out.get().reshape(sms, 3)
    mhz = [int(c) / int(t) * 1e3 for c, t, _ in v if int(t) > 0]
    return {"mhz_median": statistics.median(mhz), "mhz_min": min(mhz), "mhz_max": max(mhz), "blocks": len(mhz),
            "ns_median": statistics.median(int(t) for _, t, _ in v)}


def nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"error": "nvidia-smi not found"}
    fields = ("name", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.limit", "power.draw",
              "temperature.gpu", "driver_version", "pci.bus_id")
    out = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30)
    return {"fields": fields, "values": [x.strip() for x in out.stdout.strip().split(",")], "rc": out.returncode,
            "stderr": out.stderr[-500:]}


def device_info() -> dict:
    import torch

    p = torch.cuda.get_device_properties(0)
    info = {"name": torch.cuda.get_device_name(0), "sms": p.multi_processor_count, "cc": f"{p.major}.{p.minor}",
            "total_memory": p.total_memory, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for attr in ("L2_cache_size", "max_threads_per_multi_processor", "regs_per_multiprocessor",
                 "shared_memory_per_multiprocessor", "shared_memory_per_block_optin"):
        if hasattr(p, attr):
            info[attr] = getattr(p, attr)
    try:
        import cupy

        rt = cupy.cuda.runtime
        info["cupy"] = cupy.__version__
        # cudaDevAttrClockRate 13, MemoryClockRate 36, GlobalMemoryBusWidth 37 (kHz, kHz, bits)
        for key, attr in (("clock_khz", 13), ("memory_clock_khz", 36), ("memory_bus_bits", 37)):
            try:
                info[key] = rt.deviceGetAttribute(attr, 0)
            except Exception as exc:  # noqa: BLE001 (deprecated attributes may be absent)
                info[key] = f"unavailable: {exc}"
        from sagebwd_cp.gpu import compiler

        info["nvrtc"] = list(compiler.nvrtc_version())
    except Exception as exc:  # noqa: BLE001
        info["cupy_error"] = repr(exc)
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
        info["dirty"] = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "kernels", "ptx",
                                             "sagebwd_cp", "tools/perf_model"], capture_output=True, text=True,
                                            timeout=10).stdout.strip())
    except Exception:  # noqa: BLE001
        info["commit"] = None
    return info


def inputs(d, n):
    import torch

    b, h = max(1, TOKENS // n), HIDDEN // d
    torch.manual_seed(0)
    q, k, v, do = (torch.randn((b, h, n, d), device="cuda", dtype=torch.float16) for _ in range(4))
    return b, h, q, k, v, do


def plan_steps() -> list:
    """Every launch of the plans built so far: entry, spec key, grid, block, dynamic shared bytes
    (plan.Step.head is cuLaunchKernel's (function, grid, block, shared)); and each plan's workspace bytes."""
    from sagebwd_cp.gpu import plan

    rows = []
    for built in list(plan._plans.values()):
        for step in getattr(built, "steps", ()):
            head = tuple(getattr(step, "head", ()))
            rows.append({"entry": getattr(step, "entry", None), "spec": getattr(getattr(step, "spec", None), "key", None),
                         "grid": list(head[1:4]), "block": list(head[4:7]), "shared": head[7] if len(head) > 7 else None})
        rows.append({"plan_workspace_bytes": getattr(built, "workspace_bytes", None)})
    return rows


def measure_config(d, causal, n, reps) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp
    from bench_attention import sdpa, timed
    from probe_sdpa_kernels import kernel_times
    from probe_steps import step_times
    from sagebwd_cp.gpu import plan

    b, h, q, k, v, do = inputs(d, n)
    rec = {"head_dim": d, "causal": causal, "seqlen": n, "batch": b, "heads": h, "dtype": "float16"}
    plan.clear_plans()
    # ours: training forward (saves the LSE) and the fine backward, each launch timed
    steps, call = step_times(lambda: sagebwd_cp.attention_forward(q, k, v, causal=causal), reps)
    rec["ours_fwd"] = {"call_ms": call, "steps_ms": steps}
    out, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
    steps, call = step_times(lambda: sagebwd_cp.attention_backward(saved, do), reps)
    rec["ours_bwd"] = {"call_ms": call, "steps_ms": steps}
    rec["ours_launches"] = plan_steps()
    # FlashAttention-2 (SDPA's flash backend)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rec["fa2_fwd"] = {"call_ms": timed(lambda: sdpa(q, k, v, causal), reps)}
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = sdpa(qr, kr, vr, causal)
        bwd = lambda: torch.autograd.grad(o, (qr, kr, vr), do, retain_graph=True)  # noqa: E731
        rec["fa2_bwd"] = {"call_ms": timed(bwd, reps)}
        try:
            rec["fa2_fwd"]["kernels_us"] = kernel_times(lambda: sdpa(q, k, v, causal), 3, warmup=1)
            rec["fa2_bwd"]["kernels_us"] = kernel_times(bwd, 3, warmup=1)
        except Exception as exc:  # noqa: BLE001
            rec["fa2_profile_error"] = repr(exc)
    return rec


def ceilings() -> dict:
    from bench_attention import measure_ceilings

    return measure_ceilings()


def ncu_child(configs) -> None:
    """Runs under ncu (--profile-from-start off): each call once inside the profiled range, after a
    marker kernel of grid (index + 1) that the parser splits the rows on."""
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sagebwd_cp
    from bench_attention import sdpa

    marker = _cupy_module().get_function("perfmodel_marker")
    marks = cupy.zeros(64, dtype=cupy.int32)
    calls = []
    for d, causal, n in configs:
        b, h, q, k, v, do = inputs(d, n)
        out, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal)
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = sdpa(qr, kr, vr, causal)
        calls += [((d, causal, n, "ours_fwd"), lambda q=q, k=k, v=v, c=causal: sagebwd_cp.attention_forward(q, k, v, causal=c)),
                  ((d, causal, n, "ours_bwd"), lambda s=saved, g=do: sagebwd_cp.attention_backward(s, g)),
                  ((d, causal, n, "fa2_fwd"), lambda q=q, k=k, v=v, c=causal: sdpa(q, k, v, c)),
                  ((d, causal, n, "fa2_bwd"), lambda o=o, x=(qr, kr, vr), g=do: torch.autograd.grad(o, x, g, retain_graph=True))]
    for _, fn in calls:  # warm-up: compiles, plans
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for i, (_, fn) in enumerate(calls):
        marker((i + 1,), (32,), (marks,))
        cupy.cuda.runtime.deviceSynchronize()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("PERFMODEL_CALLS " + json.dumps([list(c) for c, _ in calls]))


def run_ncu(out_dir, metrics, tag, timeout) -> dict:
    exe = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
                                       if os.path.exists(p)), None)
    if not exe:
        return {"error": "ncu not found"}
    cmd = [exe, "--profile-from-start", "off", "--csv", "--page", "raw", "--metrics", ",".join(metrics),
           sys.executable, os.path.abspath(__file__), "--ncu-child"]
    start = time.time()
    # its own process group, so a timeout ends ncu and the profiled python together
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        with open(os.path.join(out_dir, f"ncu_{tag}.csv"), "w") as f:
            f.write(stdout or "")
        return {"error": f"timed out after {timeout} s", "seconds": time.time() - start, "stderr": (stderr or "")[-3000:]}
    res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    with open(os.path.join(out_dir, f"ncu_{tag}.csv"), "w") as f:
        f.write(res.stdout)
    calls = None
    for line in res.stdout.splitlines():
        if line.startswith("PERFMODEL_CALLS "):
            calls = json.loads(line[len("PERFMODEL_CALLS "):])
    return {"rc": res.returncode, "seconds": time.time() - start, "file": f"ncu_{tag}.csv", "calls": calls,
            "stderr": res.stderr[-3000:], "command": " ".join(cmd[:-3] + ["calibrate.py", "--ncu-child"])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for calibration.json and ncu's csv files")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the timed shapes (later ones skipped past it)")
    ap.add_argument("--ncu-timeout", type=float, default=60.0, help="seconds for each ncu run; 0 skips ncu")
    ap.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ncu_child:
        ncu_child(NCU_CONFIGS)
        return 0
    if not args.out:
        ap.error("--out DIR is required")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "calibration.json")
    t0 = time.time()
    result = {"schema": SCHEMA, "command": "python tools/perf_model/calibrate.py " + " ".join(argv or sys.argv[1:]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "env": {"SAGEBWD_WGMMA": "0"},
              "shape": {"hidden": HIDDEN, "tokens": TOKENS, "dtype": "float16", "backward": "fine"},
              "errors": [], "records": []}

    def save():
        from report_common import json_text  # benchmarks/, on the path (as bench_attention)

        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json_text(json.loads(json.dumps(result, default=str))) + "\n")
        os.replace(tmp, path)

    def section(name, fn):
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 (one try: record and go on)
            result["errors"].append({"section": name, "traceback": traceback.format_exc()[-4000:]})
            print(f"[{name}] failed:\n{traceback.format_exc()[-1500:]}", file=sys.stderr)
        save()
        print(f"[{time.time() - t0:6.1f}s] {name} done", flush=True)

    section("device", device_info)
    section("nvidia_smi_start", nvidia_smi)
    sms = (result.get("device") or {}).get("sms", 132)
    section("clock_start", lambda: measure_clock(sms))
    section("ceilings", ceilings)
    section("clock_after_ceilings", lambda: measure_clock(sms))
    # Shapes ordered so a cut-off run still covers every (d, causal) at several N.
    order = sorted(((d, c, n) for d in args.head_dims for c in (False, True) for n in args.seqlens),
                   key=lambda x: (args.seqlens.index(x[2]) % 2, x[2], x[0], x[1]))
    t_shapes = time.time()
    for d, causal, n in order:
        if time.time() - t_shapes > args.budget:
            result["errors"].append({"section": "records", "skipped": [d, causal, n], "why": "budget"})
            continue
        try:
            rec = measure_config(d, causal, n, args.reps if n < 16384 else max(5, args.reps // 2))
            result["records"].append(rec)
            print(f"[{time.time() - t0:6.1f}s] d={d} causal={causal} N={n}: ours fwd {rec['ours_fwd']['call_ms']:.3f} "
                  f"bwd {rec['ours_bwd']['call_ms']:.3f}  FA2 fwd {rec['fa2_fwd']['call_ms']:.3f} "
                  f"bwd {rec['fa2_bwd']['call_ms']:.3f} ms", flush=True)
        except Exception:  # noqa: BLE001
            result["errors"].append({"section": "records", "shape": [d, causal, n],
                                     "traceback": traceback.format_exc()[-4000:]})
            print(traceback.format_exc()[-1500:], file=sys.stderr)
        save()
    section("clock_end", lambda: measure_clock(sms))
    section("nvidia_smi_end", nvidia_smi)
    if args.ncu_timeout > 0:
        section("ncu_base", lambda: run_ncu(args.out, NCU_BASE_METRICS, "base", args.ncu_timeout))
        if (result.get("ncu_base") or {}).get("rc") == 0:
            section("ncu_pipes", lambda: run_ncu(args.out, NCU_PIPE_METRICS, "pipes", args.ncu_timeout))
    result["seconds"] = time.time() - t0
    save()
    print(f"wrote {path} ({len(result['records'])} shapes, {len(result['errors'])} errors) in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
