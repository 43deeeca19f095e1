// Shared-memory matrix loads (ldmatrix, b16). For INT8 operands an 8x8 b16 matrix is 8 rows of
// 16 bytes, which is exactly the k-contiguous fragment layout of mma m16n8k32.
#pragma once
#include "common.cuh"

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane l supplies the row address for matrix l/8.
SB_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ldmatrix.sync.aligned.m8n8.x2.shared.b16: lanes 0-15 supply the row addresses.
SB_DEVICE void ldmatrix_x2(u32 (&r)[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: transposed 16-bit load.
SB_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
