// Tensor-memory-accelerator loads (sm_90): one thread hands a whole tile to the TMA unit, which
// writes it into shared memory in the wgmma swizzle and counts its bytes on an mbarrier; the
// consumers wait on the mbarrier's phase. No per-thread addresses, no cp.async groups.
#pragma once
#include "common.cuh"

// A CUtensorMap as the driver encodes it (sagebwd_cp/tensor_map.py), passed by value as a
// __grid_constant__ kernel parameter.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

SB_DEVICE unsigned long long tensor_map_address(const TensorMap& m) { return reinterpret_cast<unsigned long long>(&m); }

// Fetch the descriptor ahead of the first load that uses it.
SB_DEVICE void prefetch_tensor_map(const TensorMap& m) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(tensor_map_address(m)) : "memory");
}

SB_DEVICE void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes initialized mbarriers visible to the TMA unit (the async proxy) before its first use.
SB_DEVICE void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Arrive once and expect `bytes` more transaction bytes in the current phase.
SB_DEVICE void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Arrive once on the current phase (no bytes expected): a consumer giving a buffer back.
SB_DEVICE void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Block until the phase with this parity has completed (its arrivals and bytes are in).
SB_DEVICE void mbarrier_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// The box of tensor map `m` at coordinates (x, y) -> shared `dst`; completion counted on `bar`.
SB_DEVICE void tma_load_2d(u32 dst, const TensorMap& m, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"(tensor_map_address(m)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

SB_DEVICE void tma_load_3d(u32 dst, const TensorMap& m, int x, int y, int z, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];" ::"r"(dst),
        "l"(tensor_map_address(m)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}

SB_DEVICE void tma_load_4d(u32 dst, const TensorMap& m, int x, int y, int z, int w, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];" ::"r"(dst),
        "l"(tensor_map_address(m)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar)
        : "memory");
}

// The box at (x, y) of the f32 tensor m += the dense box at shared `src` (a bulk group: bulk_commit, bulk_wait*).
SB_DEVICE void tma_reduce_add_2d(const TensorMap& m, int x, int y, u32 src) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                     tensor_map_address(m)),
                 "r"(x), "r"(y), "r"(src)
                 : "memory");
}

SB_DEVICE void tma_reduce_add_3d(const TensorMap& m, int x, int y, int z, u32 src) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                     tensor_map_address(m)),
                 "r"(x), "r"(y), "r"(z), "r"(src)
                 : "memory");
}

// `bytes` contiguous bytes (16-byte aligned, a multiple of 16) global -> shared, counted on `bar`.
SB_DEVICE void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
