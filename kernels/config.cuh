// The compile-time parameters every kernel file may read, with the defaults that let a file compile
// alone (specs.py sets them for each specialization; numerics.compile_defines sets the SB_BLOCK_*,
// SB_INT8_MAX, SB_P_LEVELS and SB_TINY_AMAX constants, which have no default). Each kernel's header
// comment says which of them it reads and what they mean.
#pragma once

#ifndef SB_DP
#define SB_DP 128            // padded head dim (64 or 128)
#endif
#ifndef SB_BF16
#define SB_BF16 0            // 16-bit dtype bf16 (else fp16)
#endif
#ifndef SB_CAUSAL
#define SB_CAUSAL 0          // bottom-right aligned causal mask
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
#ifndef SB_GROUPS
#define SB_GROUPS 2          // wgmma backward: warpgroups per CTA
#endif
#ifndef SB_VARLEN
#define SB_VARLEN 0          // packed batches: sequence b's tokens are rows cu_q[b].. of [total][H][D] arrays (seqinfo.cuh)
#endif
