// Hopper warpgroup matrix products (wgmma.mma_async, sm_90a): INT8 operands from shared memory
// through matrix descriptors, or A from registers. A warpgroup (4 warps) computes a 64xN tile;
// warp w holds rows 16w..16w+15 in the layout of mma.sync m16n8k32: the s32 accumulator of
// columns 8n..8n+7 is d[n][0..3] (row g cols 8n+2t, +1; row g+8 cols 8n+2t, +1), and a register
// A operand (16 rows x 32 k per warp) is the m16n8k32 A fragment.
// INT8 operands must be K-major. Shared tiles use the hardware swizzle of their row length
// (swizzle.cuh, WGMMA layouts): 128-byte rows the 128-byte mode (atom 8 x 128 B), 64-byte rows the
// 64-byte mode (atom 8 x 64 B); a tile base is aligned to its atom, and the k-step ks of a row
// starts 32·ks bytes in (the hardware applies the XOR to the address it forms).
#pragma once
#include "common.cuh"

typedef unsigned long long u64;

// Matrix descriptor of a K-major swizzled tile whose rows are ROW_BYTES (64 or 128) long, as two
// words. Low: start address in 16-byte units (bits 0-13) and the leading offset (bits 16-29, unused
// for swizzled K-major tiles). High: the stride between 8-row groups in 16-byte units (bits 0-13)
// and the swizzle mode (bits 30-31; 1: 128-byte, 2: 64-byte). A k-step or row block further into
// a tile adds its offset / 16 to the low word (the start field cannot carry out for shared
// addresses), so a loop forms each descriptor with one add.
template <int ROW_BYTES>
SB_DEVICE u32 wgmma_desc_lo(u32 addr) {
    static_assert(ROW_BYTES == 64 || ROW_BYTES == 128, "descriptors for 64- and 128-byte rows");
    return ((addr & 0x3FFFF) >> 4) | (1u << 16);
}
template <int ROW_BYTES>
SB_DEVICE u64 wgmma_desc(u32 lo, u32 byte_offset = 0) {
    constexpr u32 hi = ((8 * ROW_BYTES) >> 4) | ((ROW_BYTES == 128 ? 1u : 2u) << 30);
    u64 d;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (byte_offset >> 4)), "n"(hi));
    return d;
}

// Orders this thread's register writes (accumulators, register A operands) before later wgmma.
SB_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
SB_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
SB_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving reads of r above a wgmma_wait (or reusing it before one): an
// empty asm that claims to rewrite it.
SB_DEVICE void wgmma_hold(int& r) { asm volatile("" : "+r"(r)::"memory"); }
SB_DEVICE void wgmma_hold(u32& r) { asm volatile("" : "+r"(r)::"memory"); }

// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's reads.
SB_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// S (64x64 s32) += A (64x32, descriptor) · B (64 keys x 32, descriptor); accumulate = 0 overwrites.
SB_DEVICE void wgmma_s8_m64n64(int (&d)[8][4], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3])
        : "l"(a), "l"(b), "r"(accumulate));
}

// O (64x64 s32) += A (64x32 u8, registers) · B (64 x 32 s8, descriptor); accumulate = 0 overwrites.
SB_DEVICE void wgmma_u8s8_rega(int (&d)[8][4], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p;\n}\n"
        : "+r"(d[0][0]), "+r"(d[0][1]), "+r"(d[0][2]), "+r"(d[0][3]), "+r"(d[1][0]), "+r"(d[1][1]), "+r"(d[1][2]), "+r"(d[1][3]), "+r"(d[2][0]), "+r"(d[2][1]), "+r"(d[2][2]), "+r"(d[2][3]), "+r"(d[3][0]), "+r"(d[3][1]), "+r"(d[3][2]), "+r"(d[3][3]), "+r"(d[4][0]), "+r"(d[4][1]), "+r"(d[4][2]), "+r"(d[4][3]), "+r"(d[5][0]), "+r"(d[5][1]), "+r"(d[5][2]), "+r"(d[5][3]), "+r"(d[6][0]), "+r"(d[6][1]), "+r"(d[6][2]), "+r"(d[6][3]), "+r"(d[7][0]), "+r"(d[7][1]), "+r"(d[7][2]), "+r"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
