// Asynchronous global->shared copies (cp.async, sm_80+).
#pragma once
#include "common.cuh"

// cp.async.cg.shared.global 16 bytes; src_bytes < 16 zero-fills the rest (0 = all zeros).
SB_DEVICE void cp_async_16(u32 dst, const void* src, int src_bytes = 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// cp.async.ca.shared.global 4 bytes (a scalar such as a block's scale).
SB_DEVICE void cp_async_4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

SB_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// cp.async.wait_group N: wait until at most N committed groups are still in flight.
template <int N>
SB_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// cp.async.mbarrier.arrive.noinc: one of the mbarrier's expected arrivals, made once this thread's cp.async copies
// issued so far have landed (the barrier's count includes it).
SB_DEVICE void cp_async_mbarrier_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
