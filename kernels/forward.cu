// SageBwd forward: S = Q̂K̂ᵀ (INT8 mma m16n8k32, per-token Q and K scales), online softmax in exp2, P̂ quantized per row
// with the free scale exp2(rowmax - m_new)/255 (unsigned) and kept in registers, O += P̂V̂ (u8 x s8), FP32
// accumulation, output in the input dtype, base-2 LSE saved ([B][Hq][Lq]). Numerics: sagebwd_cp/numerics.py.
//
// Compile-time parameters:
//   SB_DP       padded head dim (64, 128 or 256)      SB_BF16    output dtype bf16 (else fp16)
//   SB_CAUSAL   bottom-right aligned causal mask       SB_BIAS    Q-smoothing bias add-back
//   SB_WARPS    warps per CTA                          SB_MT      16-row m-tiles per warp
//   SB_WGMMA    sm_90a: S and P̂V̂ as warpgroup products (wgmma) on shared tiles in wgmma layouts,
//               instead of mma.sync on ldmatrix fragments (a warpgroup: 4 warps x 16 rows; two above d=128)
//   SB_TILE_KEYS keys per tile: 64 (the V scale block), or 128 with SB_WGMMA. A 128-key tile takes
//               its row maxima, P̂'s scale and the O update once for two V blocks; P̂ then folds the
//               ratio of the blocks' V scales in (numerics.py, forward P quantization).
//   SB_DPV      wgmma above d=128: V's padded head dim (a multiple of 64 below SB_DP, else SB_DP), the V̂ᵀ rows
//               a stage holds and O's columns: MLA's 192/128 holds O for 128 columns, d=192 for 192, and
//               so takes three CTAs an SM instead of two (O has V's head dim Dv of columns, below D)
//   SB_THREADS, SB_CTA_Q  the CTA's threads and query rows (specs.ForwardTiles)
//   SB_GRID_ORDER         the grid's order (specs.forward_grid_order): BLOCKS_FIRST, or HEADS_BATCH_FIRST,
//                         whose query blocks start last to first
// Q̂ and its per-token scales: without Q-smoothing the CTA quantizes its own rows from the 16-bit Q
// (q, q_sb, q_sh, q_sn, q_prescale), as the pre-pass would (quantizer.cuh, bit for bit); with it, the
// pre-pass's q8 and q_scale (the block means need every row of the block first).
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "wgmma.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "convert.cuh"
#include "exp2.cuh"
#include "quantizer.cuh"
#include "forward_parts.cuh"
#include "softcap.cuh"

constexpr int DP = SB_DP;
constexpr int BKV = SB_BLOCK_KV;             // keys per V scale block
constexpr int TILE = SB_TILE_KEYS;           // keys per tile
constexpr int VBLOCKS = TILE / BKV;          // V scale blocks per tile
constexpr int THREADS = SB_THREADS;
constexpr int CTA_Q = SB_CTA_Q;               // query rows per CTA
static_assert(THREADS == SB_WARPS * 32 && CTA_Q == SB_WARPS * 16 * SB_MT, "SB_MT m-tiles of 16 rows a warp");
constexpr bool HEADS_BATCH_GRID = SB_GRID_ORDER == HEADS_BATCH_FIRST;
static_assert(SB_GRID_ORDER == BLOCKS_FIRST || HEADS_BATCH_GRID, "(blocks, heads, batch) or (heads, batch, blocks)");
constexpr int KSTEPS_D = DP / 32;             // k-steps of S over the head dim
constexpr int NT_KV = TILE / 8;               // n-tiles of S over the key tile
constexpr int KSTEPS_P = TILE / 32;           // k-steps of P̂V̂ over the key tile
// Head dims above 128 (mma.sync): O in two passes over the key tiles, a half of the head dim each (S and P̂
// recomputed, the same values both times), so that a thread holds O for DP/2 columns (the registers of d=128).
// A V no wider than a pass's columns (MLA's 192/128) takes the first pass alone, which then stores the LSE too.
// wgmma: one pass, O's 128 registers a thread at d=256 beside 64-key tiles' S (two CTAs an SM), or beside 128-key
// tiles' S with two warpgroups a CTA (one CTA an SM).
constexpr bool WG = SB_WGMMA;
constexpr int O_PASSES = DP > 128 && !WG ? 2 : 1;
#ifndef SB_DPV
#define SB_DPV SB_DP
#endif
constexpr int DPV = SB_DPV;                   // V's padded head dim (wgmma: O's columns)
static_assert(DPV == DP || (WG && DP > 128 && DPV % 64 == 0 && DPV < DP), "a narrower V: wgmma above d=128");
constexpr int DO = WG ? DPV : DP / O_PASSES;  // O's columns a pass
constexpr int NT_D = DO / 8;                  // n-tiles of O over a pass's columns
// wgmma above d=128: the k-steps of S past the head dim D and the 64-column P̂V̂ products past V's Dv read only
// zero padding (192 as 256, or MLA's 192/128), and are skipped; a skipped product's O columns stay zero.
constexpr bool SKIP_PADDING = WG && DP > 128;
// Shared memory: Q̂ of the CTA, then two stages of K̂, V̂ᵀ and the key tile's per-token K scales (f32).
// wgmma tiles start on their swizzle atom (1024 bytes covers both), so a stage's scales take 1024
// bytes (their padding) and the dynamic base is aligned inside 1024 bytes of slack.
struct ForwardStage {
    i8 k[TILE * DP];
    i8 vt[DO * TILE];           // the pass's rows of V̂ᵀ
    float k_scale[WG ? 1024 / 4 : TILE];
};
struct ForwardShared {
    i8 q[CTA_Q * DP];
    ForwardStage stage[2];
};
constexpr int SMEM_SLACK = WG ? 1024 : 0;
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(ForwardShared) + SMEM_SLACK;
// Members follow one another without padding (asserted), so an offset is the size of what precedes it.
constexpr int Q_BYTES = sizeof(ForwardShared::q);
constexpr int K_BYTES = sizeof(ForwardStage::k);
constexpr int V_BYTES = sizeof(ForwardStage::vt);
constexpr int KS_BYTES = 4 * TILE;            // the key tile's K scales
constexpr int STAGE_BYTES = sizeof(ForwardStage);
static_assert(STAGE_BYTES == K_BYTES + V_BYTES + sizeof(ForwardStage::k_scale) &&
              sizeof(ForwardShared) == Q_BYTES + 2 * STAGE_BYTES, "no padding in the layout");
static_assert(!WG || (Q_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0 && K_BYTES % 1024 == 0),
              "wgmma tiles start on 1024 bytes");
// wgmma: a warpgroup of 64 query rows. Above d=128, 128-key tiles take two warpgroups sharing each stage (shared
// memory holds one CTA an SM); 64-key tiles one.
static_assert(!WG || ((SB_WARPS == 4 || (DP > 128 && TILE == 2 * BKV && SB_WARPS == 8)) && SB_MT == 1),
              "the wgmma path: a warpgroup of 64 query rows, or two above d=128 with 128-key tiles");
static_assert(TILE == BKV || (WG && TILE == 2 * BKV), "128-key tiles on the wgmma path only");
static_assert(!WG || DP <= 128 || TILE == BKV || SB_WARPS == 8, "above d=128, 128-key tiles take two warpgroups");
static_assert(!WG || KS_BYTES <= 1024, "the K scales live in a stage's 1024 bytes of padding");
constexpr float PL = SB_P_LEVELS;             // P̂ codes above zero (unsigned, numerics.P_LEVELS)
// Lazy rescaling: O and l are kept relative to a per-row reference max m_ref that moves only when
// a tile's row max exceeds it by more than this (log2 units). Tile weights exp2(rmax - m_ref) stay
// at most 2^8, far from overflow, and the accumulation needs one FFMA per element and tile instead
// of a rescale by α and an FFMA. Same sums in another FP32 order (numerics: the running max).
constexpr float LAZY_LOG2 = 8.f;
// The tile's u are the base-2 logits themselves (the Q-smoothing bias or the soft-cap applied s_Q), not
// logits over s_Q (which the exponent's FMA applies).
constexpr bool LOGIT_U = SB_BIAS || SB_SOFTCAP;
constexpr float M_NONE = -1e30f;              // m_ref before any key: exp2(M_NONE - x) = 0
static_assert(SB_BLOCK_Q % 16 == 0, "a warp's 16 rows share one Q-smoothing mean block");
static_assert(BKV == 64, "V scale blocks of 64 keys: two 32-key k-steps of P̂V̂ each");

// Lane offsets of ldmatrix.x4 B fragments for two n-tiles (rows 16·p.. of a k-contiguous tile):
// matrices (n-tile 0: chunk 0, 1), (n-tile 1: chunk 0, 1).
template <int ROW_BYTES, int KSTEPS>
SB_DEVICE LaneOffsets<ROW_BYTES, KSTEPS> b_pair_lanes(int lane) {
    const int m = lane >> 3;
    return LaneOffsets<ROW_BYTES, KSTEPS>(((m >> 1) << 3) + (lane & 7), m & 1);
}

// mma.sync: one CTA per SM is the floor that lets ptxas keep every accumulator in registers (it
// otherwise trades a few spills for occupancy on sm_90). wgmma: Q̂ stays in shared memory and P̂V̂
// goes 64 columns at a time; 64-key tiles fit 4 CTAs (128 registers) without spills (5 at d=64
// measured 1% slower); 128-key tiles hold twice the S accumulator: 4 CTAs at d=64, 3 at d=128 (168
// registers; three CTAs' 76800 bytes fill the SM's shared memory). The Q-smoothing variants hold
// more and take one CTA fewer.
// Packed batches' 128-key d=64 kernels hold the sequence's bounds too and take three CTAs (168 registers;
// the dense kernel measured the same at three and four).
// Above d=128 with 64-key tiles: O's 128 registers and S's 32 leave two CTAs an SM (Q̂ and two stages: 83 KB each); a V
// head dim of 128 or 192 (SB_DPV) leaves three (64 or 96 registers of O; 67 or 77 KB). With 128-key tiles one CTA of two
// warpgroups an SM (Q̂ and two stages: 162 KB), at 255 registers (O's 128 and S's 64).
// The packed windowed soft-capped 64-key kernel at d=128 holds the rows' shares of their scores beside the bounds
// and the band's edges: at 128 registers it spilled 4 bytes (NVRTC 13.0), so it takes three CTAs.
constexpr bool HELD_ROW_SHARES = SB_SOFTCAP && SB_VARLEN && SB_WINDOW && DP > 64 && TILE == BKV;
constexpr int MIN_BLOCKS = !WG ? 1 : DP > 128 ? (SB_WARPS == 8 ? 1 : DPV < DP ? 3 : 2)
                                   : (TILE > BKV && (DP > 64 || SB_VARLEN) ? 3 : 4) - (SB_BIAS || HELD_ROW_SHARES ? 1 : 0);
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
attention_forward(SB_KERNEL_PARAMS(SB_FORWARD_FIELDS)) {
    const ForwardParams p = SB_KERNEL_VIEW(ForwardParams, SB_FORWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem[];
    static_assert(THREADS == 2 * CTA_Q, "two threads a row quantize Q (forward_parts.cuh)");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // Later query blocks have more work under the causal mask: they start first, every (head, batch
    // entry)'s before any one's next (grid (heads, batch, blocks): launch.attention_grid).
    const int qb = HEADS_BATCH_GRID ? (gridDim.z - 1 - blockIdx.z) : blockIdx.x;
    const int h = HEADS_BATCH_GRID ? blockIdx.x : blockIdx.y;
    const SeqInfo<ForwardParams> seq(p, HEADS_BATCH_GRID ? blockIdx.y : blockIdx.z);
    const int hk = seq.kv_head(h), q0 = qb * CTA_Q, hi = seq.band_hi();  // SB_CAUSAL: row r sees key c iff
                                                                          // hi - win_width <= c - r <= hi
    if (SB_VARLEN && q0 >= seq.len_q()) return;  // packed: the grid covers the longest sequence

    const u32 sQ = WG ? (smem_u32(smem) + 1023u) & ~1023u : smem_u32(smem);
    const unsigned char* smem_q = smem + (sQ - smem_u32(smem));  // the same, as a generic pointer
    const u32 sKV = sQ + Q_BYTES;
    u32 q_desc = 0;  // Q̂ tile's descriptor (low word)
    // The warpgroup's 64 rows of Q̂: rows of the tile's 128-byte column chunks (wgmma_tile_offset).
    if constexpr (WG) q_desc = wgmma_desc_lo<DP>(sQ + (SB_WARPS > 4 ? warp / 4 * 64 * (DP > 128 ? 128 : DP) : 0));
    const i8* kg = p.k8 + seq.k_row0(hk) * DP;
    const i8* vg = p.vt8 + seq.kt_base(hk, DP);
    const float* ksg = p.k_scale + seq.k_row0(hk);
    int pass = 0;  // O_PASSES: the half of the head dim whose O this pass accumulates
    const int passes = O_PASSES > 1 && p.Dv <= DP / O_PASSES ? 1 : O_PASSES;  // the passes V's head dim needs
    // K̂, the pass's rows of V̂ᵀ and the K scales of key tile jj into stage `at`.
    auto load_stage = [&](u32 at, int jj) {
        load_tile<DP, TILE, THREADS, WG>(at, kg + static_cast<i64>(jj) * TILE * DP, DP);
        load_tile<TILE, DO, THREADS, WG>(at + K_BYTES, vg + static_cast<i64>(pass) * DO * seq.nk_pad() + jj * TILE,
                                         seq.nk_pad());
        if (threadIdx.x < KS_BYTES / 16) cp_async_16(at + K_BYTES + V_BYTES + 16 * threadIdx.x, ksg + jj * TILE + 4 * threadIdx.x);
    };

    // Key tiles j_first .. n_tiles - 1: under the band, from the first row's first key to the last row's last.
    int n_tiles = (seq.len_k() + TILE - 1) / TILE, j_first = 0;
    if (SB_CAUSAL) n_tiles = min(n_tiles, max(0, (q0 + CTA_Q - 1 + hi) / TILE + 1));
    if (SB_CAUSAL && q0 + CTA_Q - 1 + hi < 0) n_tiles = 0;
    if (SB_WINDOW && q0 + seq.band_lo() > 0) j_first = (q0 + seq.band_lo()) / TILE;

    if (SB_BIAS) load_tile<DP, CTA_Q, THREADS, WG>(sQ, p.q8 + (seq.q_row0(h) + q0) * DP, DP);
    if (n_tiles > j_first) load_stage(sKV + (j_first & 1) * STAGE_BYTES, j_first);
    cp_async_commit();
    float q_row_scale = 0.f;  // without Q-smoothing: the scale of the row this thread quantized
    if (!SB_BIAS) q_row_scale = quantize_q_rows<DP, WG, CTA_Q>(sQ, p.q + seq.token(p.q_sb, p.q_sh, p.q_sn, h, 0), p.q_sn, q0, seq.len_q(), p.D, p.q_prescale, threadIdx.x);
    cp_async_wait<0>();
    if (WG) fence_proxy_async();  // cp.async and the Q̂ stores wrote what wgmma reads
    __syncthreads();

    // Q̂ fragments stay in registers for the whole key loop (mma.sync; wgmma reads the tile).
    u32 qf[SB_MT][KSTEPS_D][4];
    float qs[SB_MT][2];  // per-token Q scales of rows g, g + 8
    float rb[SB_MT][2];  // SB_SOFTCAP: the rows' shares of their scores that K-smoothing took out (0 without it)
#pragma unroll
    for (int mt = 0; mt < SB_MT; ++mt) {
        const int r0 = (warp * SB_MT + mt) * 16;
#pragma unroll
        for (int ks = 0; ks < (WG ? 0 : KSTEPS_D); ++ks) {
            const int m = lane >> 3;
            ldmatrix_x4(qf[mt][ks], sQ + swizzled_offset<DP>(r0 + ((m & 1) << 3) + (lane & 7), 2 * ks + (m >> 1)));
        }
        // A zero row's scale 0 as the smallest subnormal instead: its scores are 0 either way, and a
        // fully masked tile's row max -inf times it must stay -inf (times 0 it is NaN). A NaN scale (a
        // non-finite q) stays NaN.
        if (SB_BIAS) {
            qs[mt][0] = p.q_scale[seq.q_row0(h) + q0 + r0 + g];
            qs[mt][1] = p.q_scale[seq.q_row0(h) + q0 + r0 + g + 8];
        } else {  // row r of the CTA was quantized by lanes 2r, 2r + 1 of its warp (quantize_q_rows)
            qs[mt][0] = __shfl_sync(0xffffffffu, q_row_scale, 2 * g);
            qs[mt][1] = __shfl_sync(0xffffffffu, q_row_scale, 2 * g + 16);
        }
        qs[mt][0] = max_nan(qs[mt][0], __int_as_float(1));
        qs[mt][1] = max_nan(qs[mt][1], __int_as_float(1));
#pragma unroll
        for (int half = 0; half < 2; ++half)
            rb[mt][half] = SB_SOFTCAP && p.row_bias ? p.row_bias[seq.q_row0(h) + q0 + r0 + g + 8 * half] : 0.f;
    }

    // Loop-invariant ldmatrix offsets: K̂ tile [TILE][DP] (k-steps over d), V̂ᵀ tile [DP][TILE] (over keys).
    const LaneOffsets<DP, KSTEPS_D> k_lanes = b_pair_lanes<DP, KSTEPS_D>(lane);
    const LaneOffsets<TILE, KSTEPS_P> v_lanes = b_pair_lanes<TILE, KSTEPS_P>(lane);

    for (; pass < passes; ++pass) {
    if (pass > 0) {  // the first key tile again, now with the next half of V̂ᵀ (the last pass's reads are done)
        if (n_tiles > j_first) load_stage(sKV + (j_first & 1) * STAGE_BYTES, j_first);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }
    float o[SB_MT][NT_D][4];
    float m_ref[SB_MT][2], l_run[SB_MT][2];
#pragma unroll
    for (int mt = 0; mt < SB_MT; ++mt) {
#pragma unroll
        for (int n = 0; n < NT_D; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m_ref[mt][0] = m_ref[mt][1] = M_NONE;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int j = j_first; j < n_tiles; ++j) {
        const u32 sK = sKV + (j & 1) * STAGE_BYTES;
        const u32 sV = sK + K_BYTES;
        // Prefetch the next tile into the other stage (its readers finished before the barrier
        // at the end of the previous iteration).
        if (j + 1 < n_tiles) load_stage(sKV + ((j + 1) & 1) * STAGE_BYTES, j + 1);
        cp_async_commit();

        // S = Q̂ K̂ᵀ (exact int32).
        int s[SB_MT][NT_KV][4];
#if SB_WGMMA
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KSTEPS_D; ++ks)
            if (!SKIP_PADDING || ks == 0 || 32 * ks < p.D)
                wgmma_s8_ss(s[0], wgmma_desc<DP>(q_desc, kstep_offset<DP, CTA_Q>(ks)),
                            wgmma_desc<DP>(wgmma_desc_lo<DP>(sK), kstep_offset<DP, TILE>(ks)), ks);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int n = 0; n < NT_KV; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) wgmma_hold(s[0][n][c]);
#else
#pragma unroll
        for (int mt = 0; mt < SB_MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT_KV; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0;
#pragma unroll
        for (int ks = 0; ks < KSTEPS_D; ++ks) {
#pragma unroll
            for (int n = 0; n < NT_KV; n += 2) {
                u32 bf[4];
                ldmatrix_x4(bf, k_lanes.at(sK, ks, n / 2));
                const u32 b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
                for (int mt = 0; mt < SB_MT; ++mt) {
                    mma_s8_16832(s[mt][n], qf[mt][ks], b0);
                    mma_s8_16832(s[mt][n + 1], qf[mt][ks], b1);
                }
            }
        }
#endif

        // P̂'s coefficient per V block of the tile (numerics: forward P quantization): 255 for the
        // block with the largest V scale s_max among those holding a key < Lk, 255·s_V·(1/s_max)
        // for the other; O then adds (P̂V̂)·β·s_max/255.
        float pcoef[VBLOCKS], pv_scale;
        {
            const float* vs = p.v_scale + seq.k_block0(hk) + j * VBLOCKS;
            float sv[VBLOCKS];
#pragma unroll
            for (int vb = 0; vb < VBLOCKS; ++vb) sv[vb] = vs[vb];
            p_coefficients<VBLOCKS, BKV>(sv, j * VBLOCKS, seq.len_k(), PL, pcoef, pv_scale);
        }
        const float* ks_s = reinterpret_cast<const float*>(smem_q + Q_BYTES + (j & 1) * STAGE_BYTES + K_BYTES + V_BYTES);
        const bool need_mask = (j + 1) * TILE > seq.len_k() || (SB_CAUSAL && (j + 1) * TILE - 1 > q0 + hi);
        const bool left_edge = SB_WINDOW && j * TILE + p.win_width < q0 + CTA_Q - 1 + hi;  // a window's left edge

        u32 pf[SB_MT][KSTEPS_P][4];  // P̂ as A fragments for the 32-key k-steps
        float pv_factor[SB_MT][2], alpha[SB_MT][2];
        bool rebase = false;  // some row of this warp moves its m_ref
#pragma unroll
        for (int mt = 0; mt < SB_MT; ++mt) {
            const int rbase = q0 + (warp * SB_MT + mt) * 16 + g;
            // The warp's 16 rows lie in one Q-smoothing block.
            const float* bp = SB_BIAS ? p.bias + (seq.q_block0(h) + (rbase - g) / SB_BLOCK_Q) * seq.nk_pad() + j * TILE
                                      : nullptr;
            // u = Ŝ·s_K[key] (numerics: the key scale first, then the row's), in place of S; masked
            // entries -inf. Without the bias the row max is taken on u: s_Q > 0 commutes with it.
            float u[NT_KV][4];
            float rmax[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)};
#pragma unroll
            for (int n = 0; n < NT_KV; ++n) {
                const float2 ksn = *reinterpret_cast<const float2*>(ks_s + n * 8 + 2 * t);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int half = c >> 1, key = j * TILE + n * 8 + 2 * t + (c & 1);
                    const int row = rbase + 8 * half;
                    const bool ok = (!need_mask || (key < seq.len_k() && (!SB_CAUSAL || key <= row + hi))) &&
                                    (!left_edge || key + p.win_width >= row + hi);
                    const float x = static_cast<float>(s[mt][n][c]) * ((c & 1) ? ksn.y : ksn.x);
                    const float y = SB_BIAS      ? fmaf(x, qs[mt][half], bp[n * 8 + 2 * t + (c & 1)])
                                    : SB_SOFTCAP ? soft_cap(fmaf(x, qs[mt][half], rb[mt][half]), p.softcap2, p.inv_softcap2)
                                                 : x;
                    u[n][c] = ok ? y : -__int_as_float(0x7f800000);
                    rmax[half] = fmaxf(rmax[half], u[n][c]);
                }
            }
            float r_use[2], beta[2];
#pragma unroll
            for (int half = 0; half < 2; ++half)  // (forward_parts.cuh; O is rebased below, once the warp agrees)
                rebase |= tile_row_max(rmax[half], qs[mt][half], !LOGIT_U, LAZY_LOG2, m_ref[mt][half], alpha[mt][half],
                                       beta[half], r_use[half]);
            float rsum[2] = {0.f, 0.f};
#pragma unroll
            for (int n = 0; n < NT_KV; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int half = c >> 1;
                    const float x = exp2_approx(LOGIT_U ? u[n][c] - r_use[half] : fmaf(u[n][c], qs[mt][half], -r_use[half]));
                    u[n][c] = x;
                    rsum[half] += x;
                }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                l_run[mt][half] = fmaf(beta[half], rsum[half], alpha[mt][half] * l_run[mt][half]);
                // pv_scale is NaN or inf where a V block of the tile is: every row of the CTA turns
                // non-finite then, also one that sees no key of the tile (beta 0: 0·NaN).
                pv_factor[mt][half] = beta[half] * pv_scale;
            }
            code_p<NT_KV, BKV>(u, pcoef, pf[mt]);
        }

        // Rebase O where m_ref moved (rare after the first tile: warp-uniform branch).
        if (__any_sync(0xffffffffu, rebase)) {
#pragma unroll
            for (int mt = 0; mt < SB_MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT_D; ++n)
#pragma unroll
                    for (int c = 0; c < 4; ++c) o[mt][n][c] *= alpha[mt][c >> 1];
        }

        // O += (P̂ V̂)·(β/255)·s_V.
#if SB_WGMMA
        // 64 head-dim columns per product, one after the other: a 32-register accumulator.
#pragma unroll
        for (int dh = 0; dh < DO / 64; ++dh) {
            if (SKIP_PADDING && dh > 0 && 64 * dh >= p.Dv) break;
            int pv[8][4];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KSTEPS_P; ++kk)
                wgmma_rs<true>(pv, pf[0][kk], wgmma_desc<TILE>(wgmma_desc_lo<TILE>(sV), dh * 64 * TILE + 32 * kk), kk);
            wgmma_commit();
            wgmma_wait<0>();
#pragma unroll
            for (int kk = 0; kk < KSTEPS_P; ++kk)
#pragma unroll
                for (int x = 0; x < 4; ++x) wgmma_hold(pf[0][kk][x]);
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    wgmma_hold(pv[n][c]);
                    o[0][8 * dh + n][c] = fmaf(static_cast<float>(pv[n][c]), pv_factor[0][c >> 1], o[0][8 * dh + n][c]);
                }
        }
#else
        // Two d n-tiles at a time.
#pragma unroll
        for (int nd = 0; nd < NT_D; nd += 2) {
            int pv[SB_MT][2][4];
#pragma unroll
            for (int mt = 0; mt < SB_MT; ++mt)
#pragma unroll
                for (int x = 0; x < 2; ++x) pv[mt][x][0] = pv[mt][x][1] = pv[mt][x][2] = pv[mt][x][3] = 0;
#pragma unroll
            for (int kk = 0; kk < KSTEPS_P; ++kk) {
                u32 bf[4];
                ldmatrix_x4(bf, v_lanes.at(sV, kk, nd / 2));
                const u32 b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
                for (int mt = 0; mt < SB_MT; ++mt) {
                    mma_u8s8_16832(pv[mt][0], pf[mt][kk], b0);
                    mma_u8s8_16832(pv[mt][1], pf[mt][kk], b1);
                }
            }
#pragma unroll
            for (int mt = 0; mt < SB_MT; ++mt)
#pragma unroll
                for (int x = 0; x < 2; ++x)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        o[mt][nd + x][c] = fmaf(static_cast<float>(pv[mt][x][c]), pv_factor[mt][c >> 1], o[mt][nd + x][c]);
        }
#endif

        cp_async_wait<0>();
        if (WG) fence_proxy_async();
        __syncthreads();
    }

    // O = acc / l and the base-2 LSE (forward_parts.cuh).
#pragma unroll
    for (int mt = 0; mt < SB_MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = q0 + (warp * SB_MT + mt) * 16 + g + 8 * half;
            // Soft-capped with K-smoothing, LSE2 in the frame of K - μ_K (numerics.py): less the row's share.
            store_row<SB_BF16>(o[mt], half, l_run[mt][half], SB_SOFTCAP ? m_ref[mt][half] - rb[mt][half] : m_ref[mt][half],
                               row < seq.len_q(), p.Dv - pass * DO, t,
                               [&] { return p.out + seq.token(p.ob, p.oh, p.on, h, row) + pass * DO; },
                               pass == passes - 1 ? p.lse2 : nullptr, [&] {
                                   return (SB_VARLEN ? seq.lse_row0(h) : fresh_batch_head<HEADS_BATCH_GRID>(p.Hq) * p.Lq) + row;
                               });
        }
    }
    }  // pass
}
