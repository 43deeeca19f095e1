// Shared-memory tile addressing with the 128-byte XOR swizzle: the tile is viewed as 128-byte
// lines of eight 16-byte chunks, and the chunks of a line are permuted by XOR with a key that
// differs across eight consecutive rows, so eight ldmatrix rows or eight cp.async chunks of one
// column never share a bank. Rows of up to 128 bytes: the key is the line number (mod 8). Longer
// rows: the row number (mod 8); keyed by line, rows r and r + 4 of 256-byte rows would collide.
#pragma once
#include "common.cuh"
#include "cp_async.cuh"

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are ROW_BYTES long.
template <int ROW_BYTES>
SB_DEVICE int swizzled_offset(int row, int chunk) {
    static_assert(ROW_BYTES % 16 == 0 && (ROW_BYTES >= 128 ? ROW_BYTES % 128 == 0 : 128 % ROW_BYTES == 0),
                  "rows must tile 128-byte lines");
    const int linear = row * ROW_BYTES + chunk * 16;
    const int line = linear >> 7;
    const int c = (linear >> 4) & 7;
    const int key = ROW_BYTES > 128 ? row & 7 : line & 7;
    return (line << 7) | ((c ^ key) << 4);
}

// Copy ROWS rows of ROW_BYTES int8 from global (row stride gstride bytes) into a swizzled tile,
// 16 bytes per cp.async, spread over the THREADS threads of the block. Every count is a
// compile-time constant, so the copy unrolls and a thread's addresses advance by constant steps.
template <int ROW_BYTES, int ROWS, int THREADS>
SB_DEVICE void load_tile(u32 smem, const i8* g, i64 gstride) {
    constexpr int CHUNKS = ROW_BYTES / 16, TOTAL = ROWS * CHUNKS;
    static_assert(THREADS % CHUNKS == 0, "a pass must cover whole rows");
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const i8* src = g + r0 * gstride + c * 16;
#pragma unroll
    for (int k = 0; k < (TOTAL + THREADS - 1) / THREADS; ++k) {
        const int r = r0 + k * ROWS_PER_PASS;
        if (TOTAL % THREADS == 0 || r < ROWS)
            cp_async_16(smem + swizzled_offset<ROW_BYTES>(r, c), src + k * ROWS_PER_PASS * gstride);
    }
}
