// Shared-memory tile addressing with the 128-byte XOR swizzle: the tile is viewed as 128-byte
// lines of eight 16-byte chunks, and the chunks of a line are permuted by XOR with a key that
// differs across eight consecutive rows, so eight ldmatrix rows or eight cp.async chunks of one
// column never share a bank. Rows of up to 128 bytes: the key is the line number (mod 8). Longer
// rows: the row number (mod 8); keyed by line, rows r and r + 4 of 256-byte rows would collide.
#pragma once
#include "common.cuh"
#include "cp_async.cuh"

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are ROW_BYTES long.
// WGMMA: the layout wgmma's descriptors describe (wgmma.cuh); it differs for 64-byte rows only,
// which use the hardware's 64-byte mode: chunk XOR bits 1-2 of the row (8-row, 512-byte atoms).
template <int ROW_BYTES, bool WGMMA = false>
SB_DEVICE int swizzled_offset(int row, int chunk) {
    static_assert(ROW_BYTES % 16 == 0 && (ROW_BYTES >= 128 ? ROW_BYTES % 128 == 0 : 128 % ROW_BYTES == 0),
                  "rows must tile 128-byte lines");
    static_assert(!WGMMA || ROW_BYTES == 64 || ROW_BYTES == 128, "wgmma layouts for 64- and 128-byte rows (longer: wgmma_tile_offset)");
    if (WGMMA && ROW_BYTES == 64) return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
    const int linear = row * ROW_BYTES + chunk * 16;
    const int line = linear >> 7;
    const int c = (linear >> 4) & 7;
    const int key = ROW_BYTES > 128 ? row & 7 : line & 7;
    return (line << 7) | ((c ^ key) << 4);
}

// wgmma operand tiles (WGMMA) of ROWS rows longer than 128 bytes: 128-byte column blocks of the whole
// tile, one after the other, each in the 128-byte mode (wgmma.cuh: a k-step never crosses a block).
// Rows of up to 128 bytes: swizzled_offset's wgmma layout.
template <int ROW_BYTES, int ROWS>
SB_DEVICE int wgmma_tile_offset(int row, int chunk) {
    if constexpr (ROW_BYTES <= 128) return swizzled_offset<ROW_BYTES, true>(row, chunk);
    else return (chunk >> 3) * (ROWS * 128) + swizzled_offset<128, true>(row, chunk & 7);
}

// Rows after which the swizzle pattern repeats: moving a multiple of this many rows adds
// rows * ROW_BYTES to an offset and leaves the XOR unchanged.
template <int ROW_BYTES, bool WGMMA = false>
constexpr int swizzle_period_rows() { return ROW_BYTES >= 128 || WGMMA ? 8 : 1024 / ROW_BYTES; }

// Copy ROWS rows of ROW_BYTES int8 from global (row stride gstride bytes) into a swizzled tile,
// 16 bytes per cp.async, spread over the THREADS threads of the block. Every count is a
// compile-time constant, so the copy unrolls; when a pass spans whole swizzle periods the
// thread's shared offset is computed once and later passes add a constant. LOAD_BYTES < ROW_BYTES
// fills only the first LOAD_BYTES of each row (a tile wider than its data).
// tid: the thread's index (fresh_tid() in a register-bound loop: the addresses are rebuilt per call).
template <int ROW_BYTES, int ROWS, int THREADS, bool WGMMA = false, int LOAD_BYTES = ROW_BYTES>
SB_DEVICE void load_tile(u32 smem, const i8* g, i64 gstride, u32 tid = threadIdx.x) {
    static_assert(LOAD_BYTES % 16 == 0 && LOAD_BYTES <= ROW_BYTES, "whole chunks of a row");
    constexpr int CHUNKS = LOAD_BYTES / 16, TOTAL = ROWS * CHUNKS;
    static_assert(THREADS % CHUNKS == 0, "a pass must cover whole rows");
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    constexpr bool PERIODIC = ROWS_PER_PASS % swizzle_period_rows<ROW_BYTES, WGMMA>() == 0;
    constexpr int PITCH = WGMMA && ROW_BYTES > 128 ? 128 : ROW_BYTES;  // bytes from a row to the next
    auto offset = [](int r, int c) {
        if constexpr (WGMMA) return wgmma_tile_offset<ROW_BYTES, ROWS>(r, c);
        else return swizzled_offset<ROW_BYTES>(r, c);
    };
    const int r0 = tid / CHUNKS, c = tid % CHUNKS;
    const i8* src = g + r0 * gstride + c * 16;
    const u32 dst0 = smem + offset(r0, c);
#pragma unroll
    for (int k = 0; k < (TOTAL + THREADS - 1) / THREADS; ++k) {
        const int r = r0 + k * ROWS_PER_PASS;
        const u32 dst = PERIODIC ? dst0 + k * ROWS_PER_PASS * PITCH : smem + offset(r, c);
        if (TOTAL % THREADS == 0 || r < ROWS) cp_async_16(dst, src + k * ROWS_PER_PASS * gstride);
    }
}

// One lane's ldmatrix offsets in a swizzled tile, one per 32-byte k-step of its row: entry ks is
// the swizzled offset of chunk 2·ks + chunk. Rows ROW_STEP further add ROW_STEP·ROW_BYTES (a
// whole number of swizzle periods), so with the tile base in a uniform register every load in a
// loop is [offset + base + immediate]: no address arithmetic per load. Tile bases must be
// 128-byte aligned. (The register-bound backward keeps one offset per 128-byte line instead and
// XORs the k-step in: backward.cu, Lanes.)
template <int ROW_BYTES, int KSTEPS, int ROW_STEP = 16>
struct LaneOffsets {
    static_assert(ROW_STEP % swizzle_period_rows<ROW_BYTES>() == 0, "row steps must keep the swizzle pattern");
    static_assert(2 * KSTEPS * 16 <= ROW_BYTES, "k-steps beyond the row");
    u32 off[KSTEPS];
    SB_DEVICE LaneOffsets(int row, int chunk) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) off[ks] = swizzled_offset<ROW_BYTES>(row, 2 * ks + chunk);
    }
    SB_DEVICE u32 at(u32 tile, int ks, int row_step = 0) const { return tile + off[ks] + row_step * ROW_STEP * ROW_BYTES; }
};
