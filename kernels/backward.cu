// SageBwd backward, key/value-block owned (FlashAttention2 structure). One CTA owns 64 keys of one
// KV head and loops over every (query head of its group, query block) pair that sees them. Eight
// warps: warp w owns keys 16·(w%4).. +15 and queries 32·(w/4).. +31 of the 64x64 tile, so a warp's
// Sᵀ and dPᵀ are 16x32 (16 registers each). The two warps of a key group swap their packed P̂ᵀ
// and dŜᵀ fragments through shared memory and each accumulates dK, dV for half of the head dim.
//   Sᵀ = K̂ Q̂ᵀ (INT8)  ->  Pᵀ = exp2(Sᵀ·s_K[key]·s_Q[query] - LSE2)   (per-token Q, K scales)
//   dV += P̂ᵀ dÔ (INT8, P̂ᵀ register-fed)                      accumulated in FP32 registers
//   dPᵀ = V dOᵀ (16-bit, FP32 accumulate)  ->  dSᵀ = Pᵀ ∘ (dPᵀ - δ)
//   dK += Ẑᵀ Q̂ᵀ (INT8, Ẑ = ψ(dS) register-fed)                accumulated in FP32 registers
//   dQ += Ŷ K̂ᵀ (INT8, Ŷ = ψ(dS) through shared memory)        FP32 atomics into a [B][Hq][Nq_pad][Dp] buffer
// Q̂ᵀ and K̂ᵀ are coded per 64-token block, so their one scale leaves dQ's and dK's reductions and joins
// ψ's (numerics.py). SB_FINE = 1 quantizes P per key (dV; unsigned, 255 levels, u8 x s8 mma),
// Ẑ per key (dK) and Ŷ per query (dQ); SB_FINE = 0 uses one scale per 64x64 tile for P, Ẑ and Ŷ
// (the published per-tile scheme).
// dK leaves with the factor ln 2 (Q̂ carries c·log2 e); dQ's factor c is applied by dq_convert.
//
// Compile-time parameters:
//   SB_DP      padded head dim (64, 128 or 256)  SB_BF16           16-bit dtype bf16 (else fp16)
//   SB_CAUSAL  bottom-right aligned causal mask   SB_BIAS           Q-smoothing (bias in S, exact dK term)
//   SB_FINE    granularity (1 fine, 0 paper)      SB_DETERMINISTIC  dQ added in key-block order
//   SB_STAGES  query-side buffers in flight (1 or 2)
//   SB_THREADS, SB_CTA_KEYS, SB_KEY_PAD, SB_DQ_PITCH, SB_GRID_ORDER: the CTA's threads and keys, the
//              key-side padding, dQ's row pitch and the grid order (specs.BackwardTiles.implied)
// Hopper runs backward_wgmma.cu (warpgroup products, 128-key CTAs) with the same numerics.
#include "common.cuh"
#include "params.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "convert.cuh"
#include "exp2.cuh"
#include "backward_common.cuh"

constexpr int DP = SB_DP;
constexpr int BQ = SB_BLOCK_Q;   // queries per tile (= dO scale block)
constexpr int BKV = SB_CTA_KEYS; // keys per CTA
constexpr int KEY_GROUPS = BKV / 16;  // warps along the keys
constexpr int WARPS = 2 * KEY_GROUPS; // times two halves of the query tile
constexpr int THREADS = SB_THREADS;
constexpr int DQ_PITCH = SB_DQ_PITCH;  // dq_acc rows (floats)
static_assert(BKV == SB_BLOCK_KV, "a CTA's keys are one quantization block");
static_assert(THREADS == WARPS * 32, "a warp per 16 keys and query half");
static_assert(DQ_PITCH >= DP && DQ_PITCH % 2 == 0, "dq_acc rows hold the head dim in 8-byte aligned pairs");
constexpr int QW = BQ / 2;       // queries per warp
constexpr int NT_Q = QW / 8;     // n-tiles of a warp's Sᵀ
constexpr int NT_D = DP / 8;     // n-tiles of dK, dV, dQ over the head dim
// Head dims above 128: two passes over the query blocks, each accumulating dK, dV and dQ for a half of the head
// dim (Sᵀ, dPᵀ and the quantized dS recomputed, the same values both times): a warp then holds dK and dV for
// DP/4 columns, the registers of d=128. Not with the deterministic dQ order (one turn sequence a query block).
constexpr int D_PASSES = DP > 128 ? 2 : 1;
constexpr int NT_H = NT_D / (2 * D_PASSES);  // n-tiles a warp accumulates: its query half's share of a pass
static_assert(D_PASSES == 1 || !SB_DETERMINISTIC, "deterministic dQ takes head dims up to 128");
// Sᵀ's and dPᵀ's k-steps over the head dim, unrolled whole up to d=128; above, in groups (the same products in
// the same order: fully unrolled, ptxas ran the wide kernels' loads ahead and spilled at 255 registers).
#define K_UNROLL (SB_DP > 128 ? 4 : 16)
constexpr int KS8 = DP / 32;     // INT8 k-steps over the head dim
constexpr int KS16 = DP / 16;    // 16-bit k-steps over the head dim
// dŜ rows (queries), padded: conflict-free byte stores and ldmatrix.
constexpr int DS_PITCH = BKV + 16;
// Tiles start on 128 bytes (the swizzle's XOR addressing).
constexpr int TILE_ALIGN = 128;

// Maxima exchanged between warps (f32): per key and query half for P and for Z, per key group
// and query for Y (dQ's scales), per warp for the paper mode's tile maxima of P, Z and Y.
constexpr int RED_P = 0, RED_DSK = RED_P + 2 * BKV, RED_DSQ = RED_DSK + 2 * BKV, RED_TILE = RED_DSQ + KEY_GROUPS * BQ;
constexpr int RED_RS = RED_TILE + 3 * WARPS;  // Q-smoothing: colsum(dS) per key and query half
constexpr int RED_FLOATS = RED_RS + 2 * BKV;
// Shared memory: per-CTA tiles, then SB_STAGES query-side stages, then dŜ and reductions; swizzled
// tiles start on TILE_ALIGN bytes.
struct BackwardStage {
    i8 q[BQ * DP];          // Q̂   [64 q][DP] int8
    i8 qt[DP * BQ];         // Q̂ᵀ  [DP][64 q] int8, fragment token order
    i8 dot[DP * BQ];        // dÔᵀ [DP][64 q] int8, fragment token order
    u16 dout[BQ * DP];      // dO  [64 q][DP] 16-bit
    float4 stats[BQ];       // (LSE2, s_Q, δ, s_Qᵀ) (row_stats)
    float scale[32];        // s_dO of the query block, s_Qᵀ (soft-capped kernels), K̂ᵀ's scale, 1 (below)
};
struct BackwardShared {
    i8 k[BKV * DP];         // K̂  [64 keys][DP] int8, swizzled
    i8 kt[DP * BKV];        // K̂ᵀ [DP][64 keys] int8, swizzled
    u16 v[BKV * DP];        // V  [64 keys][DP] 16-bit, swizzled
    BackwardStage stage[SB_STAGES];
    i8 ds[BQ * DS_PITCH];   // dŜ [64 q][DS_PITCH] int8
    float red[RED_FLOATS];
    float qscale[BQ];       // dQ's Ŷ scale per query
    uint4 frag[2 * WARPS * 32];  // packed A fragments [P̂ᵀ, dŜᵀ][WARPS][32 lanes]
};
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(BackwardShared);
// Members follow one another without padding (asserted), so an offset is the size of what precedes it.
constexpr int K_OFF = 0, KT_OFF = K_OFF + sizeof(BackwardShared::k), V_OFF = KT_OFF + sizeof(BackwardShared::kt);
constexpr int STAGE0 = V_OFF + sizeof(BackwardShared::v);
constexpr int SQ = 0, SQT = SQ + sizeof(BackwardStage::q), SDOT = SQT + sizeof(BackwardStage::qt);
constexpr int SDO = SDOT + sizeof(BackwardStage::dot), SSTATS = SDO + sizeof(BackwardStage::dout);
constexpr int SSCALE = SSTATS + sizeof(BackwardStage::stats);
constexpr int STAGE_BYTES = sizeof(BackwardStage);
constexpr int DS_OFF = STAGE0 + sizeof(BackwardShared::stage), RED_OFF = DS_OFF + sizeof(BackwardShared::ds);
constexpr int QSCALE_OFF = RED_OFF + sizeof(BackwardShared::red), FRAG_OFF = QSCALE_OFF + sizeof(BackwardShared::qscale);
static_assert(STAGE_BYTES == SSCALE + sizeof(BackwardStage::scale) &&
              sizeof(BackwardShared) == FRAG_OFF + sizeof(BackwardShared::frag), "no padding in the layout");
static_assert(BKV == 64 && BQ == 64, "fragment packing assumes 64x64 tiles");
static_assert(STAGE_BYTES % TILE_ALIGN == 0 && STAGE0 % TILE_ALIGN == 0 && DS_OFF % TILE_ALIGN == 0,
              "swizzled tiles need aligned bases");

// Offset of 16-byte chunk c of row r in a [64][DP] 16-bit tile: rows of 2·DP bytes (swizzle.cuh).
SB_DEVICE int tile16_offset(int r, int c) {
    return swizzled_offset<2 * DP>(r, c);
}

// 64 rows of a strided 16-bit array into a swizzled [64][DP] tile; rows >= n_valid and columns
// >= D are zero-filled (D is a multiple of 8, so a 16-byte chunk is either all in or all out).
SB_DEVICE void load_tile16(u32 smem, const u16* g, i64 row_stride, int n_valid, int D) {
    constexpr int CHUNKS = 2 * DP / 16, ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && 64 % ROWS_PER_PASS == 0, "passes must cover whole rows");
    const int r0 = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const u16* src = g + r0 * row_stride + c * 8;
    const bool col_ok = c * 8 < D;
#pragma unroll
    for (int k = 0; k < 64 / ROWS_PER_PASS; ++k) {
        const int r = r0 + k * ROWS_PER_PASS;
        const bool ok = col_ok && r < n_valid;
        cp_async_16(smem + tile16_offset(r, c), ok ? src + k * ROWS_PER_PASS * row_stride : g, ok ? 16 : 0);
    }
}

// Per-lane ldmatrix addresses in a swizzled tile with ROW_BYTES-long rows. The 32-byte k-step ks
// of a lane's row is off[ks / 4] ^ ((ks % 4) << 5): on the chunks of one 128-byte line the swizzle
// is an XOR, so one offset per line serves every k-step (tiles are 128-byte aligned), and 16 rows
// further is +16·ROW_BYTES. Computed once per kernel, this keeps address arithmetic out of the loop.
template <int ROW_BYTES>
struct Lanes {
    static constexpr int LINES = ROW_BYTES >= 128 ? ROW_BYTES / 128 : 1;
    u32 off[LINES];
    SB_DEVICE Lanes(int row, int chunk) {
#pragma unroll
        for (int h = 0; h < LINES; ++h) off[h] = swizzled_offset<ROW_BYTES>(row, 8 * h + chunk);
    }
    // off[ks >> 2] by selects: above d=128 the k-loops are unrolled in groups (K_UNROLL), ks >> 2 is
    // not known at compile time there, and an indexed off[] would live in local memory.
    SB_DEVICE u32 line(int h) const {
        u32 o = off[0];
#pragma unroll
        for (int x = 1; x < LINES; ++x)
            if (h == x) o = off[x];
        return o;
    }
    SB_DEVICE u32 at(u32 tile, int ks, int row_block = 0) const {
        return ((tile + line(ks >> 2)) ^ ((ks & 3) << 5)) + row_block * 16 * ROW_BYTES;
    }
};

// A operand (16 rows from r0): matrices are (rows 0-7 | 8-15) x (chunk 0 | 1) in m order 0..3.
template <int ROW_BYTES>
SB_DEVICE Lanes<ROW_BYTES> a_lanes(int r0, int lane) {
    const int m = lane >> 3;
    return Lanes<ROW_BYTES>(r0 + ((m & 1) << 3) + (lane & 7), m >> 1);
}

// B operand for two n-tiles (16 rows): matrices (n-tile 0: chunk 0, 1), (n-tile 1: chunk 0, 1).
template <int ROW_BYTES>
SB_DEVICE Lanes<ROW_BYTES> b_lanes(int lane) {
    const int m = lane >> 3;
    return Lanes<ROW_BYTES>(((m >> 1) << 3) + (lane & 7), m & 1);
}

// acc[.][.] += (Â B̂)·factor[row half] over head-dim half `dh` (NT_D/2 n-tiles from dh·NT_D/2); Â is
// the two 32-column k-steps of 16 rows, B̂ a [DP][64] INT8 tile in fragment order.
// The A fragments of both 32-query k-steps: k-step qh is this warp's own, the other comes from the
// partner warp (selects, not a runtime index, so the fragments stay in registers).
SB_DEVICE void both_halves(u32 (&af)[2][4], const u32 (&own)[4], uint4 other, int qh) {
    const u32 o[4] = {other.x, other.y, other.z, other.w};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        af[0][r] = qh ? o[r] : own[r];
        af[1][r] = qh ? own[r] : o[r];
    }
}

template <bool UNSIGNED_A>
SB_DEVICE void mma_rows_into(float (&acc)[NT_H][4], const u32 (&a)[2][4], u32 tile, const Lanes<BQ>& bl, int dh,
                              const float (&factor)[2]) {
#pragma unroll
    for (int n = 0; n < NT_H; n += 2) {
        int p[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            u32 bf[4];
            ldmatrix_x4(bf, bl.at(tile, kk, (dh * NT_H + n) / 2));
            const u32 b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
            if (UNSIGNED_A) {
                mma_u8s8_16832(p[0], a[kk], b0);
                mma_u8s8_16832(p[1], a[kk], b1);
            } else {
                mma_s8_16832(p[0], a[kk], b0);
                mma_s8_16832(p[1], a[kk], b1);
            }
        }
#pragma unroll
        for (int x = 0; x < 2; ++x)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[n + x][c] = fmaf(static_cast<float>(p[x][c]), factor[c >> 1], acc[n + x][c]);
    }
}

// Two adjacent FP32 atomic adds (8-byte aligned): one vector reduction on sm_90, two before.
SB_DEVICE void red_add2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

// Two CTAs per SM at head dim 64 in the fine mode without Q-smoothing (mma.sync: 128 registers
// without spills, ~73 KB shared): the second CTA's warps hide the latency of the first's barriers and
// products. The other variants need more registers than two CTAs leave.
// Packed batches' d=64 kernels hold the sequence's bounds too and spilled 4-12 bytes at two CTAs' 128
// registers (sm_86/89 with NVRTC 13.5, sm_90 with 13.0): they take one CTA an SM, as do the soft-capped
// ones (12 bytes on sm_86/89 with NVRTC 13.0: the cap's tanh and slope), and on sm_120 the deterministic windowed
// ones (8 bytes with NVRTC 13.0, at -O1 as well).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr bool TWO_CTAS_SPILL = SB_WINDOW && SB_DETERMINISTIC;
#else
constexpr bool TWO_CTAS_SPILL = false;
#endif
constexpr int MIN_BLOCKS = DP <= 64 && SB_FINE && !SB_BIAS && !SB_VARLEN && !SB_SOFTCAP && !TWO_CTAS_SPILL ? 2 : 1;

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
attention_backward(SB_KERNEL_PARAMS(SB_BACKWARD_FIELDS)) {
    const BackwardParams a = SB_KERNEL_VIEW(BackwardParams, SB_BACKWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kw = warp % KEY_GROUPS, qh = warp / KEY_GROUPS;  // key group, query half
    const GridCell cell = backward_cell(a.grid_order);
    const int j = cell.j, hk = cell.hk, b = cell.b;
    const int group = a.Hq / a.Hkv;
    const BackwardSeq seq(a, b);
    const int hi = seq.band_hi();  // SB_CAUSAL: query r sees key c iff hi - win_width <= c - r <= hi
    if (SB_VARLEN && j * BKV >= seq.len_k()) return;  // packed: the grid covers the longest sequence

    const QueryBlocks qb = query_blocks(j * BKV, BKV, seq);
    const int i0 = qb.i0, n_i = qb.n_i;
    const int n_it = group * n_i;

    const u32 base = smem_u32(smem);
    const u32 sK = base + K_OFF, sKt = base + KT_OFF, sV = base + V_OFF;
    i8* ds_tile = reinterpret_cast<i8*>(smem + DS_OFF);
    float* red = reinterpret_cast<float*>(smem + RED_OFF);
    float* qscale_s = reinterpret_cast<float*>(smem + QSCALE_OFF);

    const int kvalid = min(BKV, seq.len_k() - j * BKV);
    load_tile<DP, BKV, THREADS>(sK, a.k8 + (seq.k_row0(hk) + j * BKV) * DP, DP);
    load_tile<BKV, DP, THREADS>(sKt, a.k8t + seq.kt_base(hk, DP) + j * BKV, seq.nk_pad());
    load_tile16(sV, a.v + seq.key_token(a.vb, a.vh, a.vn, hk, static_cast<i64>(j) * BKV), a.vn, kvalid, a.Dv);
    // K̂ᵀ's scale, beside each stage's s_dO (read from there in the loop: no register held across it).
    if (tid < SB_STAGES) {
        cp_async_4(base + STAGE0 + tid * STAGE_BYTES + SSCALE + 8, a.kt_scale + seq.k_block0(hk) + j);
        *reinterpret_cast<float*>(smem + STAGE0 + tid * STAGE_BYTES + SSCALE + 12) = 1.f;  // UNIT, below
    }

    // Query-side tiles of (query head h, query block i) into stage `slot`.
    auto load_stage = [&](int h, int i, int slot) {
        const i64 row0 = seq.q_row0(h);
        const u32 st = base + STAGE0 + slot * STAGE_BYTES;
        load_tile<DP, BQ, THREADS>(st + SQ, a.q8 + (row0 + i * BQ) * DP, DP);
        load_tile<BQ, DP, THREADS>(st + SQT, a.q8t + seq.qt_base(h, DP) + i * BQ, seq.nq_pad());
        load_tile<BQ, DP, THREADS>(st + SDOT, a.dot8 + seq.qt_base(h, DP) + i * BQ, seq.nq_pad());
        load_tile16(st + SDO, a.dout + seq.token(a.db, a.dh, a.dn, h, static_cast<i64>(i) * BQ), a.dn,
                    min(BQ, seq.len_q() - i * BQ), a.Dv);
        if (tid < BQ) cp_async_16(st + SSTATS + 16 * tid, a.stats + row0 + i * BQ + tid);
        if (tid == BQ) {
            const i64 blk = seq.q_block0(h) + i;
            cp_async_4(st + SSCALE, a.do_scale + blk);
            // Soft-capped kernels: stats' fourth slot holds each row's share of its scores, so s_Qᵀ comes here.
            if (SB_SOFTCAP) cp_async_4(st + SSCALE + 4, a.qt_scale + blk);
        }
    };
    // Iterations walk the (query head of the group, query block) pairs in sweep_advance's order
    // (backward_common.cuh): `it` is (h, i), the next load (nh, ni).
    const int h_first = hk * group, i_last = i0 + n_i - 1;
    const int i_start = SB_CAUSAL ? i_last - j % SWEEP_ROTATE % max(n_i, 1) : i0;
    int h = h_first, i = i_start, nh = h_first, ni = i_start;
    auto advance = [&](int& hh, int& ii) { sweep_advance(hh, ii, h_first, group, i0, i_last); };

    for (int pass = 0; pass < D_PASSES; ++pass) {
    const int dh = pass * 2 + qh;  // this warp's NT_H n-tiles of dK, dV and dQ start at n-tile dh·NT_H
    if (pass > 0) {
        __syncthreads();  // every warp is done with the stages of the last pass
        h = nh = h_first;
        i = ni = i_start;
    }
    if (n_it > 0) {
        load_stage(nh, ni, 0);
        advance(nh, ni);
    }
    cp_async_commit();

    const int krow = kw * 16 + g;          // this thread's key rows in the tile: krow, krow + 8
    const int key_lo = j * BKV + krow;
    const float s_k[2] = {a.k_scale[seq.k_row0(hk) + key_lo], a.k_scale[seq.k_row0(hk) + key_lo + 8]};
    const int qcol0 = qh * QW;             // first query column of this warp
    const Lanes<DP> a_k = a_lanes<DP>(kw * 16, lane), b_q = b_lanes<DP>(lane);
    const Lanes<2 * DP> a_v = a_lanes<2 * DP>(kw * 16, lane), b_do = b_lanes<2 * DP>(lane);
    const Lanes<BQ> b_t = b_lanes<BQ>(lane);  // Q̂ᵀ, dÔᵀ, K̂ᵀ: [DP][64] tiles
    // dQ: warp w computes query rows 16·(w%4).. of the tile over head-dim half w/4.
    const u32 ds_lane = smem_u32(ds_tile) + (kw * 16 + ((lane >> 3 & 1) << 3) + (lane & 7)) * DS_PITCH + (lane >> 4) * 16;
    float dk[NT_H][4], dv[NT_H][4];  // keys krow, krow+8 x the warp's columns
#pragma unroll
    for (int n = 0; n < NT_H; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) dk[n][c] = dv[n][c] = 0.f;

    for (int it = 0; it < n_it; ++it, advance(h, i)) {
        // (batch, query head) taken here and used by dQ's adds below: the row taken there (seq.q_row0)
        // costs the d=64 two-CTA kernels spills at their 128-register cap.
        const i64 bhq = seq.q_slice(h);
        cp_async_wait<0>();
        __syncthreads();  // stage `it` is in; every warp is done with the stage it will overwrite
        if (SB_STAGES > 1 && it + 1 < n_it) {
            load_stage(nh, ni, (it + 1) % SB_STAGES);
            advance(nh, ni);
        }
        cp_async_commit();

        const int stage_off = STAGE0 + (it % SB_STAGES) * STAGE_BYTES;
        const u32 st = base + stage_off;  // shared-space address, for ldmatrix
        const float4* stats_s = reinterpret_cast<const float4*>(smem + stage_off + SSTATS);
        const float s_do = *reinterpret_cast<const float*>(smem + stage_off + SSCALE);
        const int q0 = i * BQ;
        const bool need_mask = q0 + BQ > seq.len_q() || (j + 1) * BKV > seq.len_k() || (SB_CAUSAL && (j + 1) * BKV - 1 > q0 + hi);
        const bool left_edge = SB_WINDOW && j * BKV + a.win_width < q0 + BQ - 1 + hi;  // a window's left edge cuts the tile

        // Sᵀ = K̂ Q̂ᵀ (exact int32), then Pᵀ = exp2((Sᵀ·s_K)·s_Q (+ bias) - LSE2).
        float p[NT_Q][4];
        {
            int s[NT_Q][4];
#pragma unroll
            for (int n = 0; n < NT_Q; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0;
#pragma unroll K_UNROLL
            for (int ks = 0; ks < KS8; ++ks) {
                u32 ka[4];
                ldmatrix_x4(ka, a_k.at(sK, ks));
#pragma unroll
                for (int n = 0; n < NT_Q; n += 2) {
                    u32 bf[4];
                    ldmatrix_x4(bf, b_q.at(st + SQ, ks, (qcol0 / 8 + n) / 2));
                    const u32 b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                    mma_s8_16832(s[n], ka, b0);
                    mma_s8_16832(s[n + 1], ka, b1);
                }
            }
            float bias_row[2] = {0.f, 0.f};
            if (SB_BIAS) {
                const float* bp = a.bias + (seq.q_block0(h) + i) * seq.nk_pad();
                bias_row[0] = bp[key_lo];
                bias_row[1] = bp[key_lo + 8];
            }
            // probabilities() spelled out: through the call, NVRTC 13.5 spills 8 bytes of the d=64
            // two-CTA variants at their 128-register cap (sm_86, sm_89).
#pragma unroll
            for (int n = 0; n < NT_Q; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = qcol0 + n * 8 + 2 * t + c;
                    // (LSE2, s_Q) and, soft-capped, the row's share of its scores r (K-smoothing) in one load
                    const float4 st = SB_SOFTCAP ? stats_s[col] : make_float4(0.f, 0.f, 0.f, 0.f);
                    const float2 ls = SB_SOFTCAP ? make_float2(st.x, st.y) : lse_and_sq(stats_s, col);
                    const float lse = ls.x, sq = ls.y, r = st.w;
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int key = key_lo + 8 * half, q = q0 + col;
                        const float u = static_cast<float>(s[n][2 * half + c]) * s_k[half];
                        float e = exp2_approx(SB_BIAS      ? fmaf(u, sq, bias_row[half]) - lse
                                              : SB_SOFTCAP ? soft_cap(fmaf(u, sq, r), a.softcap2, a.inv_softcap2) - lse
                                                           : fmaf(u, sq, -lse));
                        if (need_mask && !(key < seq.len_k() && q < seq.len_q() && (!SB_CAUSAL || key <= q + hi))) e = 0.f;
                        if (left_edge && key + a.win_width < q + hi) e = 0.f;
                        p[n][2 * half + c] = e;
                    }
                }
        }

        // P̂ᵀ per key (over both query halves: one exchange) or per tile (paper), packed and shared
        // with the other query half's warp; dV += P̂ᵀ dÔ runs once both halves are in (after the
        // next barrier).
        uint4* frags = reinterpret_cast<uint4*>(smem + FRAG_OFF);
        u32 pf[4];
        float fac_v[2];
        {
            float m_row[2];
            row_max<false>(m_row, p);
            if (SB_FINE) {
                if (t == 0) {
                    red[RED_P + qh * BKV + krow] = m_row[0];
                    red[RED_P + qh * BKV + krow + 8] = m_row[1];
                }
            } else {
                const float m = warp_max(max_nan(m_row[0], m_row[1]));
                if (lane == 0) red[RED_TILE + warp] = m;
            }
            __syncthreads();
            if (SB_FINE) {
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    m_row[half] = max_nan(red[RED_P + krow + 8 * half], red[RED_P + BKV + krow + 8 * half]);
            } else {
                float m = red[RED_TILE];
#pragma unroll
                for (int w = 1; w < WARPS; ++w) m = max_nan(m, red[RED_TILE + w]);
                m_row[0] = m_row[1] = m;
            }
            const Psi p0 = SB_FINE ? psi_unsigned(m_row[0]) : psi(m_row[0]);
            const Psi p1 = SB_FINE ? psi_unsigned(m_row[1]) : psi(m_row[1]);
            const float inv_p[2] = {p0.inv, p1.inv};
            fac_v[0] = p0.scale * s_do;
            fac_v[1] = p1.scale * s_do;
            pack_a(pf, p, inv_p);
            frags[warp * 32 + lane] = make_uint4(pf[0], pf[1], pf[2], pf[3]);
        }

        // dPᵀ = V dOᵀ in 16-bit with FP32 accumulation, then dSᵀ = Pᵀ ∘ (dPᵀ - δ) in place.
        float ds[NT_Q][4];
#pragma unroll
        for (int n = 0; n < NT_Q; ++n) ds[n][0] = ds[n][1] = ds[n][2] = ds[n][3] = 0.f;
#pragma unroll K_UNROLL
        for (int ks = 0; ks < KS16; ++ks) {
            u32 va[4];
            ldmatrix_x4(va, a_v.at(sV, ks));
#pragma unroll
            for (int n = 0; n < NT_Q; n += 2) {
                u32 bf[4];
                ldmatrix_x4(bf, b_do.at(st + SDO, ks, (qcol0 / 8 + n) / 2));
                const u32 b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                mma_16816<SB_BF16>(ds[n], va, b0);
                mma_16816<SB_BF16>(ds[n + 1], va, b1);
            }
        }
        ds_from_dp(ds, p, stats_s, qcol0, t, a);

        // Ẑ (dK) and Ŷ (dQ) quantize dS. Their maxima of |dS|: per key for Ẑ (over both query halves),
        // per query for Ŷ (over the four key groups); or each one's tile max (paper).
        float z_row[2];
        row_max<true>(z_row, ds);
        // dS·1 for Ŷ, the 1 read from shared memory: without these multiplies NVRTC's allocation of
        // the d=64 two-CTA variants spills 4-20 bytes at their 128-register cap (13.5, sm_86-90).
        const float unit = *reinterpret_cast<const float*>(smem + stage_off + SSCALE + 12);
        float colmax[2 * NT_Q];  // |dS| of column (j/2)·8 + 2t + j%2 of the warp's 32, over this thread's 2 rows
#pragma unroll
        for (int n = 0; n < NT_Q; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) colmax[2 * n + c] = max_nan(fabsf(ds[n][c] * unit), fabsf(ds[n][2 + c] * unit));
        if (SB_FINE) {
            if (t == 0) {
                red[RED_DSK + qh * BKV + krow] = z_row[0];
                red[RED_DSK + qh * BKV + krow + 8] = z_row[1];
            }
            const float m = spread_max8(colmax, g);
            red[RED_DSQ + kw * BQ + qcol0 + (g >> 1) * 8 + 2 * t + (g & 1)] = m;
        } else {
            float my = colmax[0];
#pragma unroll
            for (int x = 1; x < 2 * NT_Q; ++x) my = max_nan(my, colmax[x]);
            const float mz = warp_max(max_nan(z_row[0], z_row[1]));
            my = warp_max(my);
            if (lane == 0) {
                red[RED_TILE + WARPS + warp] = mz;
                red[RED_TILE + 2 * WARPS + warp] = my;
            }
        }
        __syncthreads();
        Psi dk_psi[2], tile_y_psi = {1.f, 0.f};
        if (SB_FINE) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
                dk_psi[half] = psi(max_nan(red[RED_DSK + krow + 8 * half], red[RED_DSK + BKV + krow + 8 * half]));
        } else {
            float mz = red[RED_TILE + WARPS], my = red[RED_TILE + 2 * WARPS];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) {
                mz = max_nan(mz, red[RED_TILE + WARPS + w]);
                my = max_nan(my, red[RED_TILE + 2 * WARPS + w]);
            }
            dk_psi[0] = dk_psi[1] = psi(mz);
            tile_y_psi = psi(my);
        }
        {
            u32 af[2][4];
            both_halves(af, pf, frags[(warp ^ KEY_GROUPS) * 32 + lane], qh);
            mma_rows_into<SB_FINE>(dv, af, st + SDOT, b_t, dh, fac_v);
        }

        // Ŷ for dQ, stored [query][key]; per query (fine) or the tile's scale (paper). Fine: the
        // warp's 32 columns are spread one per lane (lane g·4+t takes column (g/2)·8 + 2t + g%2, one
        // ψ each) and each thread gathers the inverse scales of its 8 columns by shuffles.
        {
            float inv_col[NT_Q][2];
            if (SB_FINE) {
                const int col = qcol0 + (g >> 1) * 8 + 2 * t + (g & 1);
                float m = red[RED_DSQ + col];
#pragma unroll
                for (int w = 1; w < KEY_GROUPS; ++w) m = max_nan(m, red[RED_DSQ + w * BQ + col]);
                const Psi ps = psi(m);
                if (kw == 0) qscale_s[col] = ps.scale;
#pragma unroll
                for (int n = 0; n < NT_Q; ++n)
#pragma unroll
                    for (int c = 0; c < 2; ++c) inv_col[n][c] = __shfl_sync(0xffffffffu, ps.inv, (2 * n + c) * 4 + t);
            } else {
#pragma unroll
                for (int n = 0; n < NT_Q; ++n) inv_col[n][0] = inv_col[n][1] = tile_y_psi.inv;
            }
#pragma unroll
            for (int n = 0; n < NT_Q; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = qcol0 + n * 8 + 2 * t + c;
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        ds_tile[col * DS_PITCH + krow + 8 * half] =
                            static_cast<i8>(quant_byte(ds[n][2 * half + c] * unit, inv_col[n][c]) & 0xffu);
                }
        }

        // Q-smoothing's exact dK term needs colsum(dS) from the FP32 dS (this warp's half of it).
        float rs[2] = {0.f, 0.f};
        if (SB_BIAS) row_sum(rs, ds);

        // Ẑᵀ for dK, packed and shared like P̂ᵀ; dK += Ẑᵀ Q̂ after the next barrier.
        u32 dsf[4];
        // Q̂ᵀ's scale of the query block
        const float s_qt = SB_SOFTCAP ? *reinterpret_cast<const float*>(smem + stage_off + SSCALE + 4) : stats_s[0].w;
        const float fac_k[2] = {dk_psi[0].scale * s_qt, dk_psi[1].scale * s_qt};
        {
            const float inv_d[2] = {dk_psi[0].inv, dk_psi[1].inv};
            pack_a(dsf, ds, inv_d);
            frags[(WARPS + warp) * 32 + lane] = make_uint4(dsf[0], dsf[1], dsf[2], dsf[3]);
            if (SB_BIAS && t == 0) {
                red[RED_RS + qh * BKV + krow] = rs[0];
                red[RED_RS + qh * BKV + krow + 8] = rs[1];
            }
        }

        // The query block's dQ counter, formed where it is used (kept live across dQ it would spill at d=64).
        auto lock = [&] { return a.dq_lock + seq.q_block0(h) + i; };
        if (SB_DETERMINISTIC && tid == 0) wait_turn(lock(), dq_turn(j, i * BQ, BKV, seq));
        __syncthreads();  // Ŷ, its per-query scales and the other half's Ẑᵀ are in shared memory
        {
            u32 af[2][4];
            both_halves(af, dsf, frags[(WARPS + (warp ^ KEY_GROUPS)) * 32 + lane], qh);
            mma_rows_into<false>(dk, af, st + SQT, b_t, dh, fac_k);
        }
        if (SB_BIAS) {
            // Q-smoothing's exact dK term colsum(dS)ᵀ ⊗ μ_Q, colsum over both query halves.
            const float r0 = red[RED_RS + krow] + red[RED_RS + BKV + krow];
            const float r1 = red[RED_RS + krow + 8] + red[RED_RS + BKV + krow + 8];
            const float* mu = a.q_mean + (seq.q_block0(h) + i) * DP + dh * NT_H * 8;
#pragma unroll
            for (int n = 0; n < NT_H; ++n) {
                const float m0 = mu[n * 8 + 2 * t], m1 = mu[n * 8 + 2 * t + 1];
                dk[n][0] = fmaf(r0, m0, dk[n][0]);
                dk[n][1] = fmaf(r0, m1, dk[n][1]);
                dk[n][2] = fmaf(r1, m0, dk[n][2]);
                dk[n][3] = fmaf(r1, m1, dk[n][3]);
            }
        }

        // dQ_i += Ŷ K̂ᵀ_j: warp w computes query rows 16·(w%4).. over head-dim half w/4.
        {
            u32 da[2][4];
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) ldmatrix_x4(da[kk], ds_lane + kk * 32);
            const int r_lo = kw * 16 + g;
            float fq[2];
            const float s_kt = *reinterpret_cast<const float*>(smem + stage_off + SSCALE + 8);
            if (SB_FINE) {
                fq[0] = qscale_s[r_lo] * s_kt;
                fq[1] = qscale_s[r_lo + 8] * s_kt;
            } else {
                fq[0] = fq[1] = tile_y_psi.scale * s_kt;
            }
            // dq_acc spans Nq_pad x DQ_PITCH: padded rows and columns take (zero) updates, so no bounds checks.
            float* dq_lo = a.dq_acc + ((SB_VARLEN ? seq.q_row0(h) : bhq * seq.nq_pad()) + q0 + r_lo) * DQ_PITCH + 2 * t;
#pragma unroll
            for (int ndh = 0; ndh < NT_H; ndh += 2) {
                const int nd = dh * NT_H + ndh;
                int pq[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    u32 bf[4];
                    ldmatrix_x4(bf, b_t.at(sKt, kk, nd / 2));
                    const u32 b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
                    mma_s8_16832(pq[0], da[kk], b0);
                    mma_s8_16832(pq[1], da[kk], b1);
                }
#pragma unroll
                for (int x = 0; x < 2; ++x)
#pragma unroll
                    for (int half = 0; half < 2; ++half)
                        red_add2(dq_lo + half * 8 * DQ_PITCH + (nd + x) * 8, static_cast<float>(pq[x][2 * half]) * fq[half],
                                 static_cast<float>(pq[x][2 * half + 1]) * fq[half]);
            }
        }
        if (SB_DETERMINISTIC) {
            __threadfence();
            __syncthreads();
            if (tid == 0) pass_turn(lock(), dq_turn(j, i * BQ, BKV, seq));
        }
        if (SB_STAGES == 1 && it + 1 < n_it) {
            __syncthreads();  // the single stage is free
            load_stage(nh, ni, 0);
            advance(nh, ni);
        }
        cp_async_commit();
    }

    // dK (factor ln 2: Q̂ holds c·log2(e)·Q) and dV of this warp's columns, in the input dtype.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = key_lo + 8 * half;
        if (key >= seq.len_k()) continue;
        u16* kr = a.dk + seq.key_token(a.kb, a.kh, a.kn, hk, key);
        u16* vr = a.dv + seq.key_token(a.wb, a.wh, a.wn, hk, key);
#pragma unroll
        for (int n = 0; n < NT_H; ++n) {
            const int col = (dh * NT_H + n) * 8 + 2 * t;
            if (col >= a.D) continue;
            *reinterpret_cast<u32*>(kr + col) =
                pack2_f32<SB_BF16>(dk[n][2 * half] * 0.6931471805599453f, dk[n][2 * half + 1] * 0.6931471805599453f);
            if (col < a.Dv) *reinterpret_cast<u32*>(vr + col) = pack2_f32<SB_BF16>(dv[n][2 * half], dv[n][2 * half + 1]);
        }
    }
    }  // pass
}
