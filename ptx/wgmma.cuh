// Hopper warpgroup matrix products (wgmma.mma_async, sm_90a): INT8 operands from shared memory
// through matrix descriptors, or A from registers. A warpgroup (4 warps) computes a 64xN tile;
// warp w holds rows 16w..16w+15 in the layout of mma.sync m16n8k32: the s32 accumulator of
// columns 8n..8n+7 is d[n][0..3] (row g cols 8n+2t, +1; row g+8 cols 8n+2t, +1), and a register
// A operand (16 rows x 32 k per warp) is the m16n8k32 A fragment.
// INT8 operands must be K-major. Shared tiles use the hardware swizzle of their row length
// (swizzle.cuh, WGMMA layouts): 128-byte rows the 128-byte mode (atom 8 x 128 B), 64-byte rows the
// 64-byte mode (atom 8 x 64 B); a tile base is aligned to its atom, and the k-step ks of a row
// starts 32·ks bytes in (the hardware applies the XOR to the address it forms). 16-bit operands
// (k16 steps, also 32 bytes) use the 128-byte mode; longer rows are stored as 128-byte column
// blocks of the whole tile, one after the other (a k-step never crosses a block).
#pragma once
#include "common.cuh"

typedef unsigned long long u64;

// Matrix descriptor of a K-major swizzled tile whose rows are ROW_BYTES (64 or 128) long, or 256 stored as
// 128-byte column blocks (swizzle.cuh wgmma_tile_offset: described as 128-byte rows), as two words. Low: start address in 16-byte units (bits 0-13) and the leading offset (bits 16-29, unused
// for swizzled K-major tiles). High: the stride between 8-row groups in 16-byte units (bits 0-13)
// and the swizzle mode (bits 30-31; 1: 128-byte, 2: 64-byte). A k-step or row block further into
// a tile adds its offset / 16 to the low word (the start field cannot carry out for shared
// addresses), so a loop forms each descriptor with one add.
template <int ROW_BYTES>
SB_DEVICE u32 wgmma_desc_lo(u32 addr) {
    static_assert(ROW_BYTES == 64 || ROW_BYTES == 128 || ROW_BYTES == 256, "descriptors for 64-, 128- and 256-byte rows");
    return ((addr & 0x3FFFF) >> 4) | (1u << 16);
}
template <int ROW_BYTES>
SB_DEVICE u64 wgmma_desc(u32 lo, u32 byte_offset = 0) {
    static_assert(ROW_BYTES == 64 || ROW_BYTES == 128 || ROW_BYTES == 256, "descriptors for 64-, 128- and 256-byte rows");
    constexpr u32 hi = ((8 * (ROW_BYTES > 128 ? 128 : ROW_BYTES)) >> 4) | ((ROW_BYTES >= 128 ? 1u : 2u) << 30);
    u64 d;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (byte_offset >> 4)), "n"(hi));
    return d;
}

// Byte offset of INT8 k-step ks (32 bytes of every row) in a K-major tile of ROWS rows of ROW_BYTES, for
// wgmma_desc<ROW_BYTES>: 256-byte rows step to the next column block every four k-steps.
template <int ROW_BYTES, int ROWS>
SB_DEVICE constexpr u32 kstep_offset(int ks) {
    return ROW_BYTES > 128 ? (ks >> 2) * (ROWS * 128) + 32 * (ks & 3) : 32 * ks;
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
SB_DEVICE void wgmma_hold(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's reads.
SB_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The accumulator operands of the products below: a warp's n-tiles x 4 registers, as asm operand
// lists (c is the constraint) and as the matching register-list text.
#define SB_WG_ACC4(c, d, n) c(d[n][0]), c(d[n][1]), c(d[n][2]), c(d[n][3])
#define SB_WG_ACC16(c, d) SB_WG_ACC4(c, d, 0), SB_WG_ACC4(c, d, 1), SB_WG_ACC4(c, d, 2), SB_WG_ACC4(c, d, 3)
#define SB_WG_ACC32(c, d) SB_WG_ACC16(c, d), SB_WG_ACC4(c, d, 4), SB_WG_ACC4(c, d, 5), SB_WG_ACC4(c, d, 6), SB_WG_ACC4(c, d, 7)
#define SB_WG_ACC64(c, d) SB_WG_ACC32(c, d), SB_WG_ACC4(c, d, 8), SB_WG_ACC4(c, d, 9), SB_WG_ACC4(c, d, 10), \
    SB_WG_ACC4(c, d, 11), SB_WG_ACC4(c, d, 12), SB_WG_ACC4(c, d, 13), SB_WG_ACC4(c, d, 14), SB_WG_ACC4(c, d, 15)
#define SB_WG_REGS16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define SB_WG_REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define SB_WG_REGS64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

// D (64xN s32) += A (64x32 s8, descriptor) · B (N x 32 s8, descriptor), N = 16, 24, 32, 64, 96, 128 or 192 (the
// accumulator's n-tiles); accumulate = 0 overwrites.
SB_DEVICE void wgmma_s8_ss(int (&d)[2][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.s32.s8.s8 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p;\n}\n"
                 : SB_WG_ACC4("+r", d, 0), SB_WG_ACC4("+r", d, 1) : "l"(a), "l"(b), "r"(accumulate));
}
SB_DEVICE void wgmma_s8_ss(int (&d)[3][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k32.s32.s8.s8 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, %12, %13, p;\n}\n"
                 : SB_WG_ACC4("+r", d, 0), SB_WG_ACC4("+r", d, 1), SB_WG_ACC4("+r", d, 2) : "l"(a), "l"(b), "r"(accumulate));
}
SB_DEVICE void wgmma_s8_ss(int (&d)[4][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 " SB_WG_REGS16 ", %16, %17, p;\n}\n"
                 : SB_WG_ACC16("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}
SB_DEVICE void wgmma_s8_ss(int (&d)[8][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " SB_WG_REGS32 ", %32, %33, p;\n}\n"
                 : SB_WG_ACC32("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}
#define SB_WG_ACC96(c, d) SB_WG_ACC64(c, d), SB_WG_ACC4(c, d, 16), SB_WG_ACC4(c, d, 17), SB_WG_ACC4(c, d, 18), \
    SB_WG_ACC4(c, d, 19), SB_WG_ACC4(c, d, 20), SB_WG_ACC4(c, d, 21), SB_WG_ACC4(c, d, 22), SB_WG_ACC4(c, d, 23)
SB_DEVICE void wgmma_s8_ss(int (&d)[24][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k32.s32.s8.s8 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}" ", %96, %97, p;\n}\n"
                 : SB_WG_ACC96("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}
#define SB_WG_ACC48(c, d) SB_WG_ACC32(c, d), SB_WG_ACC4(c, d, 8), SB_WG_ACC4(c, d, 9), SB_WG_ACC4(c, d, 10), SB_WG_ACC4(c, d, 11)
SB_DEVICE void wgmma_s8_ss(int (&d)[12][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k32.s32.s8.s8 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}" ", %48, %49, p;\n}\n"
                 : SB_WG_ACC48("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}
SB_DEVICE void wgmma_s8_ss(int (&d)[16][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " SB_WG_REGS64 ", %64, %65, p;\n}\n"
                 : SB_WG_ACC64("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}

// D (64xN s32) += A (64x32 u8, descriptor) · B (N x 32 s8, descriptor), N = 32, 48 or 64: unsigned codes from shared
// memory.
SB_DEVICE void wgmma_u8s8_ss(int (&d)[4][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.s32.u8.s8 " SB_WG_REGS16 ", %16, %17, p;\n}\n"
                 : SB_WG_ACC16("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}

#define SB_WG_ACC24(c, d) SB_WG_ACC16(c, d), SB_WG_ACC4(c, d, 4), SB_WG_ACC4(c, d, 5)
SB_DEVICE void wgmma_u8s8_ss(int (&d)[6][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k32.s32.u8.s8 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}, %24, %25, p;\n}\n"
                 : SB_WG_ACC24("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}
SB_DEVICE void wgmma_u8s8_ss(int (&d)[8][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8 " SB_WG_REGS32 ", %32, %33, p;\n}\n"
                 : SB_WG_ACC32("+r", d) : "l"(a), "l"(b), "r"(accumulate));
}

// D (64xN s32) += A (64x32, registers: u8 if UNSIGNED_A, else s8) · B (N x 32 s8, descriptor).
template <bool UNSIGNED_A>
SB_DEVICE void wgmma_rs(int (&d)[4][4], const u32 (&a)[4], u64 b, int accumulate) {
    if (UNSIGNED_A)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k32.s32.u8.s8 " SB_WG_REGS16 ", {%16,%17,%18,%19}, %20, p;\n}\n"
                     : SB_WG_ACC16("+r", d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 " SB_WG_REGS16 ", {%16,%17,%18,%19}, %20, p;\n}\n"
                     : SB_WG_ACC16("+r", d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
template <bool UNSIGNED_A>
SB_DEVICE void wgmma_rs(int (&d)[8][4], const u32 (&a)[4], u64 b, int accumulate) {
    if (UNSIGNED_A)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8 " SB_WG_REGS32 ", {%32,%33,%34,%35}, %36, p;\n}\n"
                     : SB_WG_ACC32("+r", d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " SB_WG_REGS32 ", {%32,%33,%34,%35}, %36, p;\n}\n"
                     : SB_WG_ACC32("+r", d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// D (64x32 f32) += A (64x16 fp16 or bf16, descriptor) · B (32 x 16, descriptor), both K-major.
template <bool BF16>
SB_DEVICE void wgmma_f16_ss(float (&d)[4][4], u64 a, u64 b, int accumulate) {
    if (BF16)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " SB_WG_REGS16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
                     : SB_WG_ACC16("+f", d) : "l"(a), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " SB_WG_REGS16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
                     : SB_WG_ACC16("+f", d) : "l"(a), "l"(b), "r"(accumulate));
}

// D (64x64 f32) += A (64x16 fp16 or bf16, descriptor) · B (64 x 16, descriptor), both K-major
// (no transpose), unit input scales.
template <bool BF16>
SB_DEVICE void wgmma_f16_ss(float (&d)[8][4], u64 a, u64 b, int accumulate) {
    if (BF16)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SB_WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : SB_WG_ACC32("+f", d) : "l"(a), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " SB_WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : SB_WG_ACC32("+f", d) : "l"(a), "l"(b), "r"(accumulate));
}

// D (64x128 f32) += A (64x16 fp16 or bf16, descriptor) · B (128 x 16, descriptor), both K-major.
template <bool BF16>
SB_DEVICE void wgmma_f16_ss(float (&d)[16][4], u64 a, u64 b, int accumulate) {
    if (BF16)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SB_WG_REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : SB_WG_ACC64("+f", d) : "l"(a), "l"(b), "r"(accumulate));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " SB_WG_REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : SB_WG_ACC64("+f", d) : "l"(a), "l"(b), "r"(accumulate));
}

// After a wgmma_wait: every accumulator register is read only from here on.
template <int N>
SB_DEVICE void wgmma_hold_all(int (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) wgmma_hold(d[n][c]);
}
template <int N>
SB_DEVICE void wgmma_hold_all(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) wgmma_hold(d[n][c]);
}
