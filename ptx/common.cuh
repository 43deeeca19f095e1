// Types and guards shared by every kernel. No CUDA headers are included: NVRTC compiles these
// sources as they are, so 16-bit values travel as raw bits and convert through PTX.
#pragma once

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define SB_DEVICE __device__ __forceinline__

// The INT8 mma.sync, ldmatrix and cp.async paths need sm_80 or newer; trap rather than compute
// garbage if a cubin is ever run on an older device.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
#define SB_REQUIRE_SM80() asm volatile("trap;")
#else
#define SB_REQUIRE_SM80()
#endif

// A kernel file's dynamic shared memory, DYNAMIC_SHARED_BYTES (the size of its layout struct), is read
// by the host without a device: NVRTC names this variable's instantiation for it by a mangled name that
// spells the value (sagebwd_cp/compiler.py, KernelSpec.layout).
template <unsigned long long BYTES>
__device__ const char sb_dynamic_shared_bytes = 0;

SB_DEVICE u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// bar.sync on barrier `id` (1-15; 0 is __syncthreads) among THREADS threads, whole warps: a
// warpgroup's barrier that leaves the CTA's other warps running.
template <int THREADS>
SB_DEVICE void named_barrier(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory"); }

// bar.arrive on barrier `id` among THREADS threads: counts this warp in without waiting (the other
// side of a named_barrier, e.g. passing a turn to the warps that wait there).
template <int THREADS>
SB_DEVICE void named_barrier_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory"); }

// setmaxnreg (sm_90a, every warp of a warpgroup): give registers back to the CTA's pool, or take more
// from it (waits until the pool has them), so that warpgroups of different roles split the file.
template <int REGS>
SB_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
SB_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }

// threadIdx.x read through a volatile asm: values derived from it are recomputed where they are
// used instead of being held in registers across a loop (or spilled, in a register-bound kernel).
SB_DEVICE u32 fresh_tid() {
    u32 t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// The warpgroup index (threadIdx.x / 128) broadcast from lane 0: the compiler treats the result as
// warp-uniform, so values derived from it (wgmma descriptors, barrier ids) live in uniform registers
// instead of being formed per thread and moved over for every product.
SB_DEVICE int warpgroup_uniform() { return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0); }

// (batch, head) = (blockIdx.z, blockIdx.y), or (blockIdx.y, blockIdx.x) where HEAD_IN_X (causal grids
// (heads, batch, blocks): launch.attention_grid), read the same way: b * heads + h after a long loop.
template <bool HEAD_IN_X>
SB_DEVICE long long fresh_batch_head(int heads) {
    u32 h, z;
    if (HEAD_IN_X) {
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(h));
        asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(z));
    } else {
        asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(h));
        asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    }
    return static_cast<long long>(z) * heads + h;
}

// A flag word in global memory read with acquire and written with release semantics at GPU scope: what one CTA
// wrote before its release is visible to another CTA after an acquire that reads the value (the turns of the
// deterministic backward, the fused token sums of quantize.cu). No "memory" clobber: the callers' barriers and
// fences order the accesses around them for the compiler.
SB_DEVICE int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
SB_DEVICE void st_release_gpu(int* p, int v) { asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v)); }
