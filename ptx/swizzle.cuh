// Shared-memory tile addressing with the 128-byte XOR swizzle: the tile is viewed as 128-byte
// lines of eight 16-byte chunks and chunk c of line L is stored at chunk c ^ (L % 8), so eight
// ldmatrix rows or eight cp.async chunks of one column never share a bank.
#pragma once
#include "common.cuh"

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are ROW_BYTES long.
template <int ROW_BYTES>
SB_DEVICE int swizzled_offset(int row, int chunk) {
    static_assert(ROW_BYTES % 16 == 0 && (ROW_BYTES >= 128 ? ROW_BYTES % 128 == 0 : 128 % ROW_BYTES == 0),
                  "rows must tile 128-byte lines");
    const int linear = row * ROW_BYTES + chunk * 16;
    const int line = linear >> 7;
    const int c = (linear >> 4) & 7;
    return (line << 7) | ((c ^ (line & 7)) << 4);
}
