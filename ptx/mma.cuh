// Tensor-core matrix products (mma.sync, row.col).
#pragma once
#include "common.cuh"

// mma.sync.m16n8k32.row.col.s32.s8.s8.s32: A 16x32 (4 regs, 4 consecutive k per reg: row g
// cols 4t.. / row g+8 / row g cols 16+4t.. / row g+8), B 32x8 (2 regs, col g, k 4t.. and
// 16+4t..), C/D 16x8 s32 (row g cols 2t,2t+1; row g+8 cols 2t,2t+1).
SB_DEVICE void mma_s8_16832(int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The same with an unsigned A operand (u8 x s8): P̂ ≥ 0 uses all 256 codes.
SB_DEVICE void mma_u8s8_16832(int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// mma.sync.m16n8k16.row.col.f32.{f16,bf16}: A 16x16 (4 regs, 2 consecutive k per reg), B 16x8
// (2 regs), C/D 16x8 f32 in the same layout as the s32 accumulator above.
template <bool BF16>
SB_DEVICE void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}
