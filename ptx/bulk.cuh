// Asynchronous bulk reductions (sm_90): the TMA unit adds a shared-memory range into global memory,
// so the issuing threads hold no registers for it and the SM issues one instruction per range.
#pragma once
#include "common.cuh"

// global[0 .. bytes) += shared[0 .. bytes) as f32 (both 16-byte aligned, bytes a multiple of 16).
SB_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}

SB_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's bulk groups are still reading their shared source.
template <int N>
SB_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }

// Wait until at most N of this thread's bulk groups are still in flight (writes done).
template <int N>
SB_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

// Orders this thread's global-memory accesses through the async proxy (bulk reductions) with its
// generic ones (the acquire and release of a deterministic turn), both ways.
SB_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
