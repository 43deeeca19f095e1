// The compile-time parameters every kernel file may read, with the defaults that let a file compile
// alone (specs.py sets them for each specialization; numerics.compile_defines sets the SB_BLOCK_*,
// SB_INT8_MAX, SB_P_LEVELS and SB_TINY_AMAX constants, which have no default). Each kernel's header
// comment says which of them it reads and what they mean.
// The sizes the host also uses have no default either: specs.py defines them once and passes them
// (each kernel asserts what its structure needs of them):
//   SB_TOKEN_PAD   INT8 buffers hold a multiple of this many token rows (specs.TOKEN_PAD; seqinfo.cuh)
//   SB_THREADS     threads a CTA (the small kernels, the forward and backward tiles)
//   SB_CTA_Q       forward: query rows a CTA              SB_MIN_BLOCKS  forward_ws: CTAs an SM
//   SB_CTA_KEYS    backward: keys a CTA                   SB_KEY_PAD     backward: key-side INT8 padding
//   SB_DQ_PITCH    backward: floats a row of the dQ accumulator
//   SB_GRID_ORDER  forward, backward: the grid's order (GridOrder below; -1: the launch's grid_order)
//   SB_TMA_*       TMA boxes and swizzles of the tensor maps (specs.TmaBox)
//   SB_PASSES      wgmma backward: CTAs a key block, each over its part of the head dim (specs.BackwardTiles.passes)
//   SB_QUANT_THREADS, SB_QUANT_CHUNKS, SB_SUM_THREADS: quantize.cu
#pragma once

// The grid's axes (launch.attention_grid's orders; launch.py holds the same values): BLOCKS_FIRST
// (blocks, heads, batch), HEADS_FIRST (heads, blocks, batch), HEADS_BATCH_FIRST (heads, batch, blocks).
enum GridOrder { BLOCKS_FIRST = 0, HEADS_FIRST = 1, HEADS_BATCH_FIRST = 2 };

#ifndef SB_DP
#define SB_DP 128            // padded head dim (64, 128 or 256)
#endif
#ifndef SB_BF16
#define SB_BF16 0            // 16-bit dtype bf16 (else fp16)
#endif
#ifndef SB_CAUSAL
#define SB_CAUSAL 0          // a banded mask: causal and/or a sliding window (seqinfo.cuh band_lo, band_hi)
#endif
#ifndef SB_WINDOW
#define SB_WINDOW 0          // the band has a sliding window's edges (params.cuh win_right, win_width)
#endif
#ifndef SB_SOFTCAP
#define SB_SOFTCAP 0         // logit soft-capping (softcap.cuh)
#endif
#ifndef SB_BIAS
#define SB_BIAS 0            // Q-smoothing
#endif
#ifndef SB_WGMMA
#define SB_WGMMA 0           // sm_90a warpgroup products
#endif
#ifndef SB_WARPS
#define SB_WARPS 4           // forward: warps per CTA
#endif
#ifndef SB_MT
#define SB_MT 1              // forward: 16-row m-tiles per warp
#endif
#ifndef SB_TILE_KEYS
#define SB_TILE_KEYS SB_BLOCK_KV  // forward: keys per tile
#endif
#ifndef SB_FINE
#define SB_FINE 1            // backward: granularity (1 fine, 0 paper)
#endif
#ifndef SB_DETERMINISTIC
#define SB_DETERMINISTIC 0   // backward: dQ added in key-block order
#endif
#ifndef SB_STAGES
#define SB_STAGES 2          // backward: query-side buffers in flight
#endif
#ifndef SB_VARLEN
#define SB_VARLEN 0          // packed batches: sequence b's tokens are rows cu_q[b].. of [total][H][D] arrays (seqinfo.cuh)
#endif
