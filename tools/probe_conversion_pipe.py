"""Which pipe an int32 -> float32 conversion issues to, and at what rate, beside ex2 and FFMA: the
question the conversion fold (docs/PERFORMANCE.md, instruction diet) turns on. Each kernel runs
independent chains of one instruction kind (a template parameter: no branch in the loop) (and one mixes conversions with ex2); printed as
instructions per clock per SM. If conversions and ex2 together take as long as their sum alone, they
share a pipe (the XU), and folding the conversion into an FMA moves it off the pipe the softmax's ex2
needs.

    python tools/probe_conversion_pipe.py
"""
from __future__ import annotations

SOURCE = r"""
template <int KIND>
__global__ void probe(int iters, float* out) {
    float f[8]; int n[8];
    for (int i = 0; i < 8; ++i) { f[i] = threadIdx.x * 1e-3f + i; n[i] = threadIdx.x + 7 * i; }
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (KIND == 0) {        // I2F: int -> float, fed back as an int
                float x; asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(x) : "r"(n[i])); n[i] = __float_as_int(x);
            } else if (KIND == 1) { // FFMA
                asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(f[i]) : "f"(0.999f), "f"(1e-3f));
            } else if (KIND == 2) { // MUFU.EX2
                asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
            } else if (KIND == 3) { // one I2F and one EX2 each step
                float x; asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(x) : "r"(n[i])); n[i] = __float_as_int(x);
                asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(f[i]));
            } else {                // IADD (the fold's integer add)
                asm volatile("add.s32 %0, %0, 0x4B400000;" : "+r"(n[i]));
            }
        }
    }
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += f[i] + __int_as_float(n[i]);
    if (s == 1234.5f) out[0] = s;
}
"""
KINDS = {0: "I2F (cvt.rn.f32.s32)", 1: "FFMA", 2: "MUFU.EX2", 3: "I2F + EX2 mixed", 4: "IADD"}


def main():
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    sms, clock_khz = props["multiProcessorCount"], props["clockRate"]
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=[f"probe<{k}>" for k in KINDS])
    out = cupy.zeros(1, cupy.float32)
    blocks, threads, iters = sms * 8, 256, 4096
    print(props["name"].decode(), f"{sms} SMs, nominal clock {clock_khz / 1e6:.2f} GHz")
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    kernels = {kind: module.get_function(f"probe<{kind}>") for kind in KINDS}
    for _ in range(20):  # clocks up before the first timing
        for kernel in kernels.values():
            kernel((blocks,), (threads,), (cupy.int32(iters), out))
    for kind, name in KINDS.items():
        times = []
        for _ in range(5):
            start.record()
            kernels[kind]((blocks,), (threads,), (cupy.int32(iters), out))
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        ms = sorted(times)[2]
        per_kind = 2 if kind == 3 else 1
        instructions = blocks * threads * iters * 8 * per_kind  # thread-instructions
        rate = instructions / (ms * 1e-3) / sms / (clock_khz * 1e3)
        print(f"{name:24s} {ms:8.3f} ms  {rate:7.1f} thread-instructions / clock / SM (at the nominal clock)")


if __name__ == "__main__":
    main()
