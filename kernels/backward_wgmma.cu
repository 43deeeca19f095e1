// SageBwd backward on Hopper (sm_90a): warpgroup products (wgmma) and CTAs of 2 computing warpgroups
// (128 keys). The numerics are backward.cu's (quantization blocks of 64 keys x 64 queries,
// the same scales and products); the shape is another. Warpgroup w owns keys 64w..64w+63 of the
// CTA and every query of the 64-query block; warp v of a warpgroup owns 16 of those keys, so its Sᵀ
// and dPᵀ are 16 keys x 64 queries. A key's maxima (P and Z, per key) stay inside a warp, a
// query's (Y, per query) inside its warpgroup: no fragment exchange, two CTA-wide barriers per
// iteration, and one dQ reduction per CTA's keys.
//   Sᵀ = K̂ Q̂ᵀ (m64n64k32 s8)            ->  Pᵀ = exp2(Sᵀ·s_K[key]·s_Q[query] - LSE2)
//   dPᵀ = V dOᵀ (m64n64k16 f16/bf16)     ->  dSᵀ = Pᵀ ∘ (dPᵀ - δ)
//   dV += P̂ᵀ dÔ, dK += Ẑᵀ Q̂ᵀ (m64nCk32 chunks, C = CHUNK_COLS; P̂ᵀ, Ẑᵀ register-fed)
//                                        FP32 registers, 64 keys x DP per warpgroup
//   dQ += Σ_w ŷ_w[query]·(Ŷ_w K̂ᵀ_w) (from shared memory; warpgroup w computes head-dim slice w)
// Ŷ and Ẑ quantize dS itself: Q̂ᵀ and K̂ᵀ are coded per 64-token block, whose scale joins ψ's (numerics.py).
// dQ's partial of the CTA's keys goes through a shared [64][DP+8] f32 tile to one bulk reduction
// (deterministic: in key-block order). See backward.cu for P, Z and Y and their scales.
//
// Head dims above 128 (SB_DP 256): dK, dV and dQ in PASSES = 2 halves of the head dim, one a CTA (neighbours on
// the grid's key-block axis, block · PASSES + pass: specs.BackwardTiles.passes), each CTA computing Sᵀ, dPᵀ and
// the quantizations over the whole head dim (the same values in both), so that a thread holds the accumulators of
// d=128; one stage (the tiles fill shared memory), loaded by the producer warpgroup. Head dims up to 192 split 192
// columns and V's head dim instead (SB_DQK, SB_DPV below; two stages where V's are 128). Deterministic, the two CTAs
// of key block j add their dQ halves in turns PASSES·j + pass of the query block's counter.
//
// Compile-time parameters: SB_DP (64, 128 or 256), SB_BF16, SB_CAUSAL, SB_BIAS, SB_FINE,
// SB_DETERMINISTIC as in backward.cu; SB_STAGES = 2, or 1 at SB_DP 256 (with SB_WS); SB_WS: a
// producer warpgroup after the computing ones, whose first warp issues the stage loads (a "full" and an "empty"
// mbarrier a stage) and whose second issues dQ's bulk reductions (the tile's "full" and "empty" mbarriers), while
// the computing warpgroups take 232 registers (setmaxnreg; 240 in the soft-capped wide kernels) and never issue a
// load or wait for a reduction;
// SB_DQ_TILES (WS only: 1 or 2) dQ partial tiles, written and reduced in turn. From specs.BackwardTiles.implied:
// SB_THREADS, SB_CTA_KEYS (a warpgroup per 64 keys), SB_KEY_PAD, SB_DQ_PITCH, SB_GRID_ORDER (-1: the
// launch's), and the query-side tensor maps' boxes (specs.BackwardTiles.query_maps): SB_TMA_QROWS
// query rows (Q̂, dO) or columns (Q̂ᵀ, dÔᵀ) a box, SB_TMA_Q_COLS bytes of a Q̂ box's rows, SB_TMA_QT_ROWS rows of a
// Q̂ᵀ or dÔᵀ box, SB_TMA_DO_COLS columns of a dO box, and the swizzles SB_TMA_SWIZZLE_Q, _QT and _DO.
#include "backward_common.cuh"
#include "wgmma.cuh"
#include "bulk.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "tma.cuh"

constexpr int DP = SB_DP;
constexpr int BQ = SB_BLOCK_Q;       // queries per tile (= dO scale block)
constexpr int BKV = SB_BLOCK_KV;     // keys per warpgroup (= the quantization block)
constexpr int GROUPS = 2;            // computing warpgroups (specs.WGMMA_GROUPS)
constexpr int CTA_KEYS = SB_CTA_KEYS;
constexpr int THREADS = SB_THREADS;  // the computing warpgroups' threads
static_assert(CTA_KEYS == GROUPS * BKV && THREADS == GROUPS * 128, "a warpgroup per 64 keys");
#ifndef SB_WS
#define SB_WS 0
#endif
constexpr bool WS = SB_WS;
constexpr int CTA_THREADS = THREADS + (WS ? 128 : 0);  // the launch's: the computing warpgroups, then the producer
constexpr int PASSES = SB_PASSES;  // CTAs a key block, dK, dV and dQ for DH head-dim columns each
// The head dims the passes split: Q·K's (SB_DQK) and V's (SB_DPV), each DP unless narrower (head dims up to 192 at a
// padded DP of 256: the passes then take 96 columns of dK and dQ each, and dV's half of V's, not 128 of each, the
// rest padding; V's and dO's tiles hold V's columns alone).
#ifndef SB_DQK
#define SB_DQK SB_DP
#endif
#ifndef SB_DPV
#define SB_DPV SB_DP
#endif
constexpr int DQK = SB_DQK, DPV = SB_DPV;
static_assert((DQK == DP && DPV == DP) || (PASSES > 1 && DQK <= DP && DPV <= DQK && DPV % 128 % 64 == 0),
              "narrower dims only in the wide kernels; V's tiles in whole 64-column blocks");
constexpr int DH = DQK / PASSES;    // dK's and dQ's columns (K̂ᵀ's and Q̂ᵀ's rows) a pass
constexpr int DHV = DPV / PASSES;   // dV's columns (dÔᵀ's rows) a pass
constexpr int KROW = DP > 128 ? 128 : DP;  // bytes from a row of K̂ or Q̂ to the next (swizzle.cuh wgmma_tile_offset)
static_assert(PASSES == 1 || (WS && SB_FINE && !SB_BIAS), "head dims above 128: the producer's loads, fine granularity, "
                                                         "no Q-smoothing");
// dQ partial tiles (SB_DQ_TILES, specs.BackwardTiles.dq_tiles): WS with two, the computing warps write one while the
// producer's reduction reads the other.
constexpr int DQ_TILES = SB_DQ_TILES;
static_assert(DQ_TILES == 1 || (WS && DQ_TILES == 2), "a second dQ tile needs the producer's reductions");
// setmaxnreg moves registers inside the CTA's launch allocation (168 a thread at 384 threads), so the split must fit
// it. The soft-capped wide kernels' computing warps take 240 (at 232 the split stage spilled 24 bytes); at 24 the
// dense causal kernels' producer loops spilled, so those keep 40.
constexpr bool WIDE_SOFTCAP = SB_SOFTCAP && PASSES > 1;
constexpr int PRODUCER_REGS = WIDE_SOFTCAP ? 24 : 40, CONSUMER_REGS = WIDE_SOFTCAP ? 240 : 232;
static_assert(!WS || 128 * PRODUCER_REGS + THREADS * CONSUMER_REGS <= (65536 / CTA_THREADS) / 8 * 8 * CTA_THREADS,
              "setmaxnreg.inc waits forever for registers the CTA was not given");
// The computing warpgroups' barrier (bar.sync ids 1..GROUPS are each warpgroup's own); the whole CTA's without a
// producer, which leaves the loop's barriers.
constexpr int BAR_COMPUTE = 1 + GROUPS;
constexpr int NT_Q = BQ / 8;         // n-tiles of a warp's Sᵀ (the whole query block)
// Two warpgroups at head dim 64 use about 185 of the 255 registers a thread may hold at one CTA per
// SM; the spare ones keep work out of shared memory and save products (ROOMY):
constexpr bool ROOMY = DP == 64;
// dK and dV in chunks of CHUNK_COLS columns, one m64nCHUNK_COLS product each (a chunk's int32 registers
// are in flight beside dK, dV and dS: 16 for 32 columns; at head dim 64 one 64-column chunk fits).
constexpr int CHUNK_COLS = ROOMY ? 64 : 32;
constexpr int CHUNKS = DH / CHUNK_COLS, CHUNKS_V = DHV / CHUNK_COLS;  // dK's, dV's
static_assert(CHUNKS_V <= CHUNKS && CHUNKS <= 4, "dV's chunks fold in four steps (dv_step), dK's follow");
constexpr int NT_CH = CHUNK_COLS / 8;  // n-tiles of a chunk
// dQ: warpgroup w computes DQ_COLS head-dim columns from DQ_COL0(w) over every key block of the CTA,
// and stores them.
constexpr int DQ_COLS = DH / GROUPS;
constexpr int NT_DQ = DQ_COLS / 8;   // n-tiles of a warpgroup's dQ columns
// dQ's products go DQ_CHUNK_COLS columns at a time, every key block's at once (GROUPS int32 accumulators
// of DQ_CHUNK_NT n-tiles in flight): 32 columns; 16 in the soft-capped wide kernels (32 spilled there).
constexpr int DQ_CHUNK_NT = NT_DQ < 4 ? NT_DQ : WIDE_SOFTCAP || NT_DQ % 4 ? 2 : 4;  // (6 n-tiles: 3 x 16 columns)
constexpr int DQ_CHUNK_COLS = 8 * DQ_CHUNK_NT, DQ_CHUNKS = NT_DQ / DQ_CHUNK_NT;
static_assert(NT_DQ % DQ_CHUNK_NT == 0, "whole chunks");
SB_DEVICE int dq_col0(int w) { return w * DQ_COLS; }
// Tiles with a key axis (K̂ᵀ, Ŷ) hold it in 128-byte rows, the CTA's 128 keys (one 128-byte swizzle block).
constexpr int KEY_BLOCKS = CTA_KEYS / 128;
static_assert(CTA_KEYS == 128 && DQ_COLS % 8 == 0, "two warpgroups of 64 keys");
constexpr int KS8 = DP / 32;         // INT8 k-steps over the head dim
constexpr int KS16 = DPV / 16;       // 16-bit k-steps over V's head dim
// Above d=128 the k-steps that read only zero padding are skipped: Sᵀ's past the head dim D and dPᵀ's past V's Dv
// (192 runs as 256, MLA's 192/128 with V's columns 128-255 zero). The first k-step is always issued (one that starts
// the accumulator conditionally spilled). (Skipping dV's chunks past Dv, by a branch or a guard predicate, spilled
// 8-40 bytes: a skipped product leaves its registers' old values live.)
constexpr bool SKIP_PADDING = DP > 128;
static_assert(BKV == 64 && BQ == 64, "fragment packing assumes 64x64 blocks");

// Maxima exchanged inside a warpgroup (f32): Y per query from each warp; the paper mode's tile
// maxima of P, Z and Y per warp.
constexpr int RED_Y = 0, RED_TILE = RED_Y + GROUPS * 4 * BQ, RED_FLOATS = RED_TILE + 3 * 4 * GROUPS;
constexpr int DQ_PITCH = SB_DQ_PITCH;  // dq_acc rows (specs.BackwardTiles.dq_row), padded (DP + 8)
constexpr int DQ_TILE_PITCH = DH + 8;  // dQ tile rows, padded: a warp's 8-byte stores hit every bank; at one pass the
                                       // tile and dq_acc's rows are one range each
static_assert(DQ_PITCH >= DP && DQ_PITCH % 4 == 0, "rows hold the head dim, 16-byte aligned for the bulk copies");
static_assert(PASSES > 1 || DQ_TILE_PITCH == DQ_PITCH, "one pass: the tile is dq_acc's rows");
static_assert(SB_TMA_DQ_COLS == DQ_TILE_PITCH, "tm_dq's box is a dQ tile");
// The TMA boxes: Q̂ one query block of DP-byte rows; Q̂ᵀ, dÔᵀ DP rows of a query block's bytes; dO
// DPV / DO_COLS boxes of the query block's rows x DO_COLS 16-bit columns (128 bytes: tile16_offset's
// column blocks); each box in the swizzle of its row's bytes, which the wgmma descriptors and
// tile16_offset read.
constexpr int DO_COLS = SB_TMA_DO_COLS;
constexpr int Q_COLS = SB_TMA_Q_COLS;
static_assert(SB_TMA_QROWS == BQ, "a box spans one query block");
#ifndef SB_TMA_DOT_ROWS
#define SB_TMA_DOT_ROWS SB_TMA_QT_ROWS
#endif
static_assert(Q_COLS == KROW && SB_TMA_QT_ROWS == DH && SB_TMA_DOT_ROWS == DHV,
              "Q̂ boxes are its column blocks, Q̂ᵀ and dÔᵀ boxes a pass's rows");
static_assert(2 * DO_COLS == 128 && DPV % DO_COLS == 0, "dO boxes are 128-byte column blocks");
static_assert(SB_TMA_SWIZZLE_Q == Q_COLS && SB_TMA_SWIZZLE_QT == BQ && SB_TMA_SWIZZLE_DO == 2 * DO_COLS,
              "each box in the swizzle of its rows");
// Shared memory: per-CTA tiles, then SB_STAGES query-side stages' tiles, then Ŷ, the reductions, the stages'
// rows and mbarriers, and dQ. Every wgmma tile starts on a 1024-byte swizzle atom; the dynamic base is aligned
// with 896 bytes of slack.
constexpr int TILE_ALIGN = 1024;
struct BackwardStage {      // a whole number of swizzle atoms
    i8 q[BQ * DP];          // Q̂   [64 q][DP] int8, 128-byte column blocks
    i8 qt[DH * BQ];         // Q̂ᵀ  [DH][64 q] int8, fragment token order: the pass's rows
    i8 dot[DHV * BQ];       // dÔᵀ [DHV][64 q] int8, fragment token order: the pass's rows
    u16 dout[BQ * DPV];     // dO  [64 q][DPV] 16-bit, 128-byte column blocks
};
struct StageRows {          // a stage's rows and mbarriers (kept out of the tiles: their atoms stay unpadded)
    float4 stats[BQ];       // (LSE2, s_Q, δ, s_Qᵀ)
    unsigned long long bar[16];  // in 128 bytes: [0] full (the stage's TMA loads' bytes); WS: [1] empty (every
                                 // computing warp is done with it), and in stage 0 from [2] on dQ tile b's full
                                 // (written, [2 + 2b]) and empty (read by its reduction, [3 + 2b]); SPLIT: [0] and
                                 // [1] part 0's, [4] and [5] part 1's, and [6, 7] part 1's copy of stats[0]
};
struct BackwardShared {
    i8 k[CTA_KEYS * DP];             // K̂  [keys][DP] int8, 128-byte column blocks
    i8 kt[KEY_BLOCKS][DH * 128];     // K̂ᵀ [key block][DH][128 keys] int8: the pass's rows
    u16 v[CTA_KEYS * DPV];           // V  [keys][DPV] 16-bit, 128-byte column blocks
    BackwardStage stage[SB_STAGES];
    i8 ds[KEY_BLOCKS][BQ * 128];     // Ŷ [key block][64 q][128 keys] int8
    float dq[DQ_TILES][BQ * DQ_TILE_PITCH];  // the dQ partials' tiles (iteration it: it % DQ_TILES), on 1024 bytes
                                             // (tm_dq's reductions read them: 128)
    float red[RED_FLOATS];
    float yscale[GROUPS * BQ];       // Ŷ's scale per (key block, query)
    int turn[4];                     // deterministic windows: the turns (dq_turn) of two iterations' dQ partials;
                                     // PASSES > 1: each dQ tile's first row in dq_acc
    StageRows rows[SB_STAGES];
};
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(BackwardShared) + (TILE_ALIGN - 128);
// Members follow one another without padding (asserted), so an offset is the size of what precedes it.
constexpr int K_OFF = 0, KT_OFF = K_OFF + sizeof(BackwardShared::k), V_OFF = KT_OFF + sizeof(BackwardShared::kt);
constexpr int STAGE0 = V_OFF + sizeof(BackwardShared::v);
constexpr int SQ = 0, SQT = SQ + sizeof(BackwardStage::q), SDOT = SQT + sizeof(BackwardStage::qt);
constexpr int SDO = SDOT + sizeof(BackwardStage::dot);
constexpr int STAGE_BYTES = sizeof(BackwardStage);
constexpr int SBAR = sizeof(StageRows::stats), ROWS_BYTES = sizeof(StageRows);  // in a StageRows
constexpr u32 STAGE_LOAD_BYTES = STAGE_BYTES + SBAR;  // a stage's tiles and rows, padding and zero fill included
// One stage (SB_STAGES 1, with the producer): in two parts, each loaded once the computing warps are done with its
// last contents, so that both loads run under computation: part 0, Q̂, dO and the rows' statistics (Sᵀ, dPᵀ, the
// softmax and dS), is free once dS is formed; part 1, Q̂ᵀ and dÔᵀ (dV, dK), once the dK products are done.
// (Soft-capped kernels split it too, their computing warps with 240 registers, dPᵀ issued once Pᵀ is formed and dQ's
// products in chunks of 16 columns: short of any of these, they spilled 8-32 bytes.)
constexpr bool SPLIT = WS && SB_STAGES == 1;
constexpr u32 PART0_BYTES = sizeof(BackwardStage::q) + sizeof(BackwardStage::dout) + SBAR;
// and stats[0] again (s_Qᵀ; soft-capped kernels copy s_Qᵀ alone, by cp.async, below)
constexpr u32 PART1_BYTES = sizeof(BackwardStage::qt) + sizeof(BackwardStage::dot) + (SB_SOFTCAP ? 0 : 16);
static_assert(PART0_BYTES + PART1_BYTES == STAGE_LOAD_BYTES + (SB_SOFTCAP ? 0 : 16), "the parts are the stage");
constexpr int DS_OFF = STAGE0 + sizeof(BackwardShared::stage), DQ_OFF = DS_OFF + sizeof(BackwardShared::ds);
constexpr int RED_OFF = DQ_OFF + sizeof(BackwardShared::dq);
constexpr int YSCALE_OFF = RED_OFF + sizeof(BackwardShared::red), TURN_OFF = YSCALE_OFF + sizeof(BackwardShared::yscale);
constexpr int ROWS0 = TURN_OFF + sizeof(BackwardShared::turn);
static_assert(STAGE_BYTES == BQ * DP + (DH + DHV) * BQ + 2 * BQ * DPV && sizeof(BackwardShared) == ROWS0 + sizeof(BackwardShared::rows),
              "no padding in the layout");
static_assert(STAGE0 % TILE_ALIGN == 0 && STAGE_BYTES % TILE_ALIGN == 0 && DS_OFF % TILE_ALIGN == 0,
              "wgmma tiles need aligned bases");
static_assert(DQ_OFF % 128 == 0 && ROWS0 % 16 == 0, "bulk copies need 16-byte aligned shared ranges, TMA's 128");
static_assert(SB_STAGES == 2 || (WS && SB_STAGES == 1), "the next stage loads while this one is read (or, one stage, "
                                                         "once the producer has it back)");

constexpr int DQ_TILE_BYTES = BQ * DQ_TILE_PITCH * 4;
// WS mbarriers: a stage's "empty" beside its "full"; in stage 0, dQ tile b's "full" and "empty".
// Stage s's tiles and rows.
SB_DEVICE constexpr int stage_at(int s) { return STAGE0 + s * STAGE_BYTES; }
SB_DEVICE constexpr int rows_at(int s) { return ROWS0 + s * ROWS_BYTES; }
constexpr int SBAR_EMPTY = SBAR + 8;
// SPLIT: part 1's; soft-capped kernels' s_Qᵀ in STATS1 too
constexpr int SBAR_FULL1 = SBAR + 32, SBAR_EMPTY1 = SBAR + 40, SBAR_STATS1 = SBAR + 48;
static_assert(!SPLIT || DQ_TILES == 1, "part 1's mbarriers where dQ tile 1's would be");
// Arrivals of the barrier that s_Qᵀ's copy lands on (FULL, or SPLIT FULL1): the loading thread's arrive with the
// TMA bytes, and soft-capped also its cp.async's (cp_async_mbarrier_arrive_noinc).
constexpr int FULL_ARRIVALS = SB_SOFTCAP ? 2 : 1;
SB_DEVICE constexpr int dq_full_bar(int b) { return ROWS0 + SBAR + 16 + 16 * b; }
SB_DEVICE constexpr int dq_empty_bar(int b) { return ROWS0 + SBAR + 24 + 16 * b; }
static_assert(SBAR + 24 + 16 * (DQ_TILES - 1) + 8 <= SBAR + 128, "the mbarriers fit the stage's 128 bytes");

// The computing warpgroups wait for one another (the whole CTA where there is no producer).
SB_DEVICE void compute_sync() {
    if constexpr (WS) named_barrier<THREADS>(BAR_COMPUTE);
    else __syncthreads();
}

// Offset of 16-byte chunk c of row r in a [ROWS][DPV] 16-bit tile stored as 128-byte column blocks.
template <int ROWS>
SB_DEVICE int tile16_offset(int r, int c) { return wgmma_tile_offset<2 * DPV, ROWS>(r, c); }

// ROWS rows of a strided 16-bit array into a [ROWS][DPV] tile; rows >= n_valid and columns >= D are
// zero-filled (D is a multiple of 8, so a 16-byte chunk is either all in or all out).
template <int ROWS>
SB_DEVICE void load_tile16(u32 smem, const u16* g, i64 row_stride, int n_valid, int D) {
    constexpr int CH = 2 * DPV / 16;
    const u32 tid = threadIdx.x;
    if constexpr (THREADS % CH != 0) {  // (V's head dim 192: 24 chunks a row) chunk by chunk
        static_assert(ROWS * CH % THREADS == 0, "passes must cover whole tiles");
#pragma unroll
        for (int k = 0; k < ROWS * CH / THREADS; ++k) {
            const int x = tid + k * THREADS, r = x / CH, c = x % CH;
            const bool ok = c * 8 < D && r < n_valid;
            cp_async_16(smem + tile16_offset<ROWS>(r, c), ok ? g + r * row_stride + c * 8 : g, ok ? 16 : 0);
        }
    } else {
        constexpr int ROWS_PER_PASS = THREADS / CH;
        static_assert(ROWS % ROWS_PER_PASS == 0, "passes must cover whole rows");
        const int r0 = tid / CH, c = tid % CH;
        const u16* src = g + r0 * row_stride + c * 8;
        const bool col_ok = c * 8 < D;
#pragma unroll
        for (int k = 0; k < ROWS / ROWS_PER_PASS; ++k) {
            const int r = r0 + k * ROWS_PER_PASS;
            const bool ok = col_ok && r < n_valid;
            cp_async_16(smem + tile16_offset<ROWS>(r, c), ok ? src + k * ROWS_PER_PASS * row_stride : g, ok ? 16 : 0);
        }
    }
}

// The int32 product Â B̂ of a warpgroup's 64 keys over head-dim chunk `chunk` (CHUNK_COLS columns), Â
// the two 32-query k-steps in registers, B̂ a [DP][64 q] INT8 tile (64-byte rows) with descriptor low
// word tile_lo; rows_finish folds it into acc after a wgmma_wait.
template <bool UNSIGNED_A>
SB_DEVICE void rows_issue(int (&pr)[NT_CH][4], const u32 (&a)[2][4], u32 tile_lo, int chunk) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
        wgmma_rs<UNSIGNED_A>(pr, a[kk], wgmma_desc<BQ>(tile_lo, chunk * CHUNK_COLS * BQ + 32 * kk), kk);
    wgmma_commit();
}
SB_DEVICE void rows_finish(float (&acc)[NT_CH][4], int (&pr)[NT_CH][4], u32 (&a)[2][4], const float (&factor)[2]) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) wgmma_hold(a[kk][r]);
    wgmma_hold_all(pr);
#pragma unroll
    for (int n = 0; n < NT_CH; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[n][c] = fmaf(static_cast<float>(pr[n][c]), factor[c >> 1], acc[n][c]);
}

// The query-side tiles come by TMA (tm_*: params.cuh SB_BACKWARD_MAPS, encoded per call by sagebwd_cp/tensor_map.py).
extern "C" __global__ void __launch_bounds__(CTA_THREADS, 1)
attention_backward(SB_KERNEL_PARAMS(SB_BACKWARD_FIELDS), SB_KERNEL_MAPS(SB_BACKWARD_MAPS)) {
    const BackwardParams a = SB_KERNEL_VIEW(BackwardParams, SB_BACKWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((TILE_ALIGN - smem_u32(smem_raw) % TILE_ALIGN) % TILE_ALIGN);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wg = warp / 4, wv = warp % 4;  // warpgroup (64-key block), warp inside it (16 keys)
    const GridCell cell = backward_cell(a.grid_order);
    const int j = cell.j / PASSES, hk = cell.hk, b = cell.b;
    // The CTA's part of the head dim, formed where used (held, the producer's 40 registers spilled).
    auto fresh_pass = [&] { return PASSES > 1 ? backward_cell(a.grid_order).j % PASSES : 0; };
    const int group = a.Hq / a.Hkv;
    const BackwardSeq seq(a, b);
    const int hi = seq.band_hi();  // SB_CAUSAL: query r sees key c iff hi - win_width <= c - r <= hi
    static_assert(CTA_KEYS == BACKWARD_CTA_KEYS, "backward_common.cuh's key count");
    if (SB_VARLEN && j * CTA_KEYS >= seq.len_k()) return;  // packed: the grid covers the longest sequence

    const QueryBlocks qb = query_blocks(j * CTA_KEYS, CTA_KEYS, seq);
    const int i0 = qb.i0, n_i = qb.n_i;
    const int n_it = group * n_i;

    const u32 base = smem_u32(smem);
    const u32 sK = base + K_OFF, sKt = base + KT_OFF, sV = base + V_OFF;
    i8* ds_tile = reinterpret_cast<i8*>(smem + DS_OFF);
    float* red = reinterpret_cast<float*>(smem + RED_OFF);
    float* yscale_s = reinterpret_cast<float*>(smem + YSCALE_OFF);

    const int kvalid = min(CTA_KEYS, seq.len_k() - j * CTA_KEYS);
    // K̂ and V in one cp.async group, K̂ᵀ in a second, waited for only before the first dQ products (in the loop).
    if (!WS || tid < THREADS) {  // (WS: the producer's threads load no key-side tile)
    load_tile<DP, CTA_KEYS, THREADS, true>(sK, a.k8 + (seq.k_row0(hk) + j * CTA_KEYS) * DP, DP);
    load_tile16<CTA_KEYS>(sV, a.v + seq.key_token(a.vb, a.vh, a.vn, hk, static_cast<i64>(j) * CTA_KEYS), a.vn, kvalid, a.Dv);
    cp_async_commit();
#pragma unroll
    for (int kb2 = 0; kb2 < KEY_BLOCKS; ++kb2) {  // K̂ᵀ's rows of the pass
        constexpr int LAST = CTA_KEYS - 128 * (KEY_BLOCKS - 1);  // keys of the last block
        const i8* src = a.k8t + seq.kt_base(hk, DP) + static_cast<i64>(fresh_pass()) * DH * seq.nk_pad() + j * CTA_KEYS + 128 * kb2;
        if (kb2 + 1 < KEY_BLOCKS)
            load_tile<128, DH, THREADS, true>(sKt + kb2 * DH * 128, src, seq.nk_pad());
        else
            load_tile<128, DH, THREADS, true, LAST>(sKt + kb2 * DH * 128, src, seq.nk_pad());
    }
    }

    // Query-side tiles of (query head h, query block i) into stage `slot` (Q̂ᵀ's and dÔᵀ's rows of the pass):
    // issued by one thread.
    // SPLIT: `parts` 1 or 2, part 0 or 1 alone.
    auto load_stage = [&](int h, int i, int slot, int parts = 3) {
        const u32 st = base + stage_at(slot), rows = base + rows_at(slot), bar = rows + SBAR;
        const u32 bar1 = SPLIT ? rows + SBAR_FULL1 : bar;
        if (SB_SOFTCAP && (parts & 2)) {
            // Soft-capped kernels: stats' fourth slot holds each row's share of its scores, so the block's s_Qᵀ
            // comes here, before the arrival that could complete the phase.
            cp_async_4(rows + SBAR_STATS1 + 12, a.qt_scale + seq.q_block0(h) + i);
            cp_async_mbarrier_arrive_noinc(bar1);  // the barrier's second arrival (FULL_ARRIVALS)
        }
        if (!SPLIT) mbarrier_arrive_expect_tx(bar, STAGE_LOAD_BYTES);
        if (parts & 1) {
            if (SPLIT) mbarrier_arrive_expect_tx(bar, PART0_BYTES);
            tma_load_3d(st + SQ, tm_q, 0, static_cast<int>(seq.q_row0(h)) + i * BQ, 0, bar);  // its column blocks in one box
        }
        if (parts & 2) {
            if (SPLIT) mbarrier_arrive_expect_tx(bar1, PART1_BYTES);
            const int qt_row = static_cast<int>(seq.qt_row0(h, DP)), pass = fresh_pass();  // the head's first row
            tma_load_2d(st + SQT, tm_qt, seq.qt_col0() + i * BQ, qt_row + pass * DH, bar1);
            tma_load_2d(st + SDOT, tm_dot, seq.qt_col0() + i * BQ, qt_row + pass * DHV, bar1);
            if (SPLIT && !SB_SOFTCAP) bulk_load(rows + SBAR_STATS1, a.stats + seq.q_row0(h) + i * BQ, 16, bar1);
        }
        if (!(parts & 1)) return;
        // Packed: dO is one [1][Hq][total][D] tensor; rows past this sequence's end are the next one's, which
        // padded rows' P = 0 (LSE2 = +inf, δ = 0 there) keeps out of every product.
        auto load_do = [&](int cb) {
            tma_load_4d(st + SDO + cb * BQ * (2 * DO_COLS), tm_do, DO_COLS * cb, seq.q_start() + i * BQ, h,
                        SB_VARLEN ? 0 : seq.b, bar);
        };
        if constexpr (PASSES > 1) {
#pragma unroll 1  // (unrolled, the producer's 40 registers spilled)
            for (int cb = 0; cb < DPV / DO_COLS; ++cb) load_do(cb);
        } else {
#pragma unroll
            for (int cb = 0; cb < DPV / DO_COLS; ++cb) load_do(cb);
        }
        bulk_load(rows, a.stats + seq.q_row0(h) + i * BQ, 16 * BQ, bar);
    };
    // Iterations walk the (query head of the group, query block) pairs in sweep_advance's order
    // (backward_common.cuh): `it` is (h, i), the next load (nh, ni).
    const int h_first = hk * group, i_last = i0 + n_i - 1;
    const int i_start = SB_CAUSAL ? i_last - j % SWEEP_ROTATE % max(n_i, 1) : i0;
    int h = h_first, i = i_start, nh = h_first, ni = i_start;
    auto advance = [&](int& hh, int& ii) { sweep_advance(hh, ii, h_first, group, i0, i_last); };

    cp_async_commit();
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < SB_STAGES; ++s) {
            mbarrier_init(base + rows_at(s) + SBAR, SPLIT ? 1 : FULL_ARRIVALS);
            if (WS) mbarrier_init(base + rows_at(s) + SBAR_EMPTY, THREADS);
            if (SPLIT) {
                mbarrier_init(base + rows_at(s) + SBAR_FULL1, FULL_ARRIVALS);
                mbarrier_init(base + rows_at(s) + SBAR_EMPTY1, THREADS);
            }
        }
        if (WS) {
#pragma unroll
            for (int b = 0; b < DQ_TILES; ++b) {
                mbarrier_init(base + dq_full_bar(b), THREADS / 32);
                mbarrier_init(base + dq_empty_bar(b), 1);
            }
        }
        fence_mbarrier_init();
        prefetch_tensor_map(tm_q);
        prefetch_tensor_map(tm_qt);
        prefetch_tensor_map(tm_dot);
        prefetch_tensor_map(tm_do);
        if (PASSES > 1) prefetch_tensor_map(tm_dq);
        if (!WS && n_it > 0) load_stage(nh, ni, 0);
    }
    if (!WS && n_it > 0) advance(nh, ni);
    if (PASSES > 1 && tid < BQ * DQ_TILES) {  // the dQ tiles' padding columns, which tm_dq's box adds too: zeros
        float* pad = reinterpret_cast<float*>(smem + DQ_OFF) + tid * DQ_TILE_PITCH + DH;
#pragma unroll
        for (int c = 0; c < DQ_TILE_PITCH - DH; ++c) pad[c] = 0.f;
    }
    cp_async_wait<1>();
    fence_proxy_async();  // cp.async wrote K̂ and V, which wgmma reads
    __syncthreads();      // and the mbarriers are initialized

    const int krow = wv * 16 + g;            // this thread's key rows in the warpgroup's block: krow, krow + 8
    // The thread index that values used in the loop are formed from: a fresh read in the register-bound
    // kernels (values derived from it, held across the loop, would spill), so that the compiler forms
    // them where used; ROOMY kernels keep them, and form them once.
    auto loop_tid = [] { return ROOMY ? static_cast<u32>(threadIdx.x) : fresh_tid(); };
    // The warpgroup index for descriptors and barrier ids: ROOMY kernels hold it in a uniform register
    // (a broadcast), so that the K̂, V and K̂ᵀ descriptors are formed on the uniform datapath; the others
    // form it where used (the uniform form saved them 3% of the loop's instructions, but no time).
    const int wg_held = warpgroup_uniform();
    auto loop_wg = [&] { return ROOMY ? wg_held : static_cast<int>(loop_tid() >> 7); };
    // This thread's first key; in the loop it is rebuilt from loop_tid(), as are the other
    // warpgroup-dependent values there.
    const int key_lo = j * CTA_KEYS + wg * BKV + krow;
    // The keys' scales, read here (the soft-capped wide kernels read them once their registers are in: here, they
    // spilled).
    float s_k[2];
    auto read_key_scales = [&] {
        s_k[0] = a.k_scale[seq.k_row0(hk) + key_lo];
        s_k[1] = a.k_scale[seq.k_row0(hk) + key_lo + 8];
    };
    if (!WIDE_SOFTCAP) read_key_scales();
    // Descriptor low words of K̂ᵀ and of Ŷ (the warpgroup's K̂ and V rows: per iteration, below).
    const u32 kt_desc = wgmma_desc_lo<128>(sKt), ds_desc = wgmma_desc_lo<128>(smem_u32(ds_tile));
    // Y maxima: lane (g, t) takes query columns ycol and ycol + 32 (spread_max8's order).
    auto ycol = [&] {
        const int ft = loop_tid(), fg = ft >> 2 & 7;
        return (fg >> 1) * 8 + 2 * (ft & 3) + (fg & 1);
    };

    // The dQ partial of a query block waits in its shared tile until the next iteration; there, once its
    // warpgroup's products are issued, thread REDUCER (not thread 0, which issues the stage loads) adds
    // it into dq_acc with one bulk reduction. Issued at the top of the iteration with the loads, the
    // reduction held the copy engine while thread 0's later loads waited, and warp 0's warpgroup waited
    // for warp 0 at its first product. Deterministic: key blocks (CTAs) add into a query block in
    // order, so that thread waits for its turn and passes it on once the reduction's writes are done.
    constexpr int REDUCER = (GROUPS - 1) * 128;
    const u32 dq_s = base + DQ_OFF;
    i64 pending_row = -1;  // the partial's first row in dq_acc ([B][Hq][Nq_pad] rows); -1: none yet
    // The partial in the tile at shared address `tile` added into dq_acc's rows from `row`; deterministic: in turn
    // `turn` of the query block's counter.
    auto reduce_rows = [&](i64 row, int turn, u32 tile) {
        if (SB_DETERMINISTIC) {
            wait_turn(a.dq_lock + row / BQ, turn);
            fence_proxy_async_global();
        }
        bulk_reduce_add_f32(a.dq_acc + row * DQ_PITCH, tile, DQ_TILE_BYTES);
        bulk_commit();
        if (SB_DETERMINISTIC) {
            bulk_wait<0>();
            fence_proxy_async_global();
            __threadfence();
            pass_turn(a.dq_lock + row / BQ, turn);
        }
    };
    // The partial's turn: j, or under a window (dq_turn) the one the thread left in shared memory at the
    // top of iteration `it` (slot it % 2; formed later, or held across the loop, it spilled).
    int* turn_s = reinterpret_cast<int*>(smem + TURN_OFF);
    auto reduce_dq = [&](int it) { reduce_rows(pending_row, SB_WINDOW ? turn_s[it & 1] : j, dq_s); };

    // WS: the producer warpgroup. Its first warp's lane 0 loads the stages of every iteration once the computing
    // warps have released the stage's previous use; its second warp's lane 0 adds each iteration's dQ partial into
    // dq_acc once the computing warps have written the tile (deterministic: in its turn), and releases the tile once
    // the reduction has read it. The other lanes and warps leave.
    if (WS && tid >= THREADS) {
        setmaxnreg_dec<PRODUCER_REGS>();
        const int pwarp = (tid - THREADS) >> 5;
        int ph = h_first, pi = i_start;
        if ((tid & 31) == 0 && pwarp == 0) {  // (two loops, not one: the producer's 40 registers hold either)
            for (int it = 0; it < n_it; ++it, advance(ph, pi)) {
                const int slot = it % SB_STAGES;
                if (it >= SB_STAGES) mbarrier_wait(base + rows_at(slot) + SBAR_EMPTY, ((it / SB_STAGES) & 1) ^ 1);
                if (SPLIT) {
                    load_stage(ph, pi, slot, 1);
                    if (it >= SB_STAGES) mbarrier_wait(base + rows_at(slot) + SBAR_EMPTY1, ((it / SB_STAGES) & 1) ^ 1);
                    load_stage(ph, pi, slot, 2);
                } else {
                    load_stage(ph, pi, slot);
                }
            }
        } else if (PASSES > 1 && (tid & 31) == 0 && pwarp == 1) {
            // PASSES > 1: the whole tile, its 8 columns of zeros too, into dq_acc's box from the pass's first column
            // (the zeros land in the next pass's first columns or the rows' padding); the partial's first row from
            // the computing warps, in turn_s[tile], so that this loop holds no sweep of its own.
            for (int it = 0; it < n_it; ++it) {
                const int b = it % DQ_TILES;
                mbarrier_wait(base + dq_full_bar(b), (it / DQ_TILES) & 1);
                // Deterministic: the passes of key block j (the grid's block·PASSES + pass) add in turns PASSES·j +
                // pass of the query block's one counter (under a window, j counted from the block's first key block:
                // dq_turn of the block's first row q0, recovered from its row in dq_acc's [..][Nq_pad] rows).
                auto row = [&] { return *reinterpret_cast<volatile int*>(turn_s + b); };
                auto turn = [&] {
                    const int cell = backward_cell(a.grid_order).j;
                    if (!SB_WINDOW) return cell;
                    const int q0 = row() % a.Nq_pad - seq.qt_col0();
                    return dq_turn(cell / PASSES, q0, CTA_KEYS, seq) * PASSES + cell % PASSES;
                };
                if (SB_DETERMINISTIC) {
                    wait_turn(a.dq_lock + row() / BQ, turn());
                    fence_proxy_async_global();
                }
                tma_reduce_add_2d(tm_dq, fresh_pass() * DH, *reinterpret_cast<volatile int*>(turn_s + b), dq_s + b * DQ_TILE_BYTES);
                bulk_commit();
                if (SB_DETERMINISTIC) {
                    bulk_wait<0>();
                    fence_proxy_async_global();
                    __threadfence();
                    pass_turn(a.dq_lock + row() / BQ, turn());
                }
                bulk_wait_read<0>();
                mbarrier_arrive(base + dq_empty_bar(b));
            }
        } else if ((tid & 31) == 0 && pwarp == 1) {
            for (int it = 0; it < n_it; ++it, advance(ph, pi)) {
                const i64 row = seq.q_row0(ph) + pi * BQ;
                const int turn = SB_WINDOW ? dq_turn(j, pi * BQ, CTA_KEYS, seq) : j;
                const int b = it % DQ_TILES;
                mbarrier_wait(base + dq_full_bar(b), (it / DQ_TILES) & 1);
                reduce_rows(row, turn, dq_s + b * DQ_TILE_BYTES);
                bulk_wait_read<0>();
                mbarrier_arrive(base + dq_empty_bar(b));
            }
        }
        return;
    }
    if (WS) setmaxnreg_inc<CONSUMER_REGS>();
    if (WIDE_SOFTCAP) read_key_scales();

    // Keys krow, krow+8 x the pass's head-dim columns CHUNK_COLS·chunk + 8n + 2t, +1.
    float dk[CHUNKS][NT_CH][4], dv[CHUNKS_V][NT_CH][4];  // dV: the pass's columns of V's head dim (DHV)
#pragma unroll
    for (int ch = 0; ch < CHUNKS; ++ch)
#pragma unroll
        for (int n = 0; n < NT_CH; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                dk[ch][n][c] = 0.f;
                if (ch < CHUNKS_V) dv[ch][n][c] = 0.f;
            }
    auto fold_dk = [&](int ch, int (&pr)[NT_CH][4], u32 (&zf)[2][4], const float (&f)[2]) {
        rows_finish(dk[ch], pr, zf, f);
    };
    // Stage `slot`'s rows (LSE2, s_Q, δ, s_Qᵀ), at an address formed where it is read.
    auto stage_rows = [&](int slot) { return reinterpret_cast<const float4*>(smem + rows_at(slot)); };

    for (int it = 0; it < n_it; ++it, advance(h, i)) {
        // Every warp is done with the last iteration's Ŷ, its scales and maxima (WS), or also with the stage
        // that is loaded next and with the dQ tile.
        compute_sync();
        if (!WS && tid == 0 && it + 1 < n_it) load_stage(nh, ni, (it + 1) % SB_STAGES);
        if (!WS && it + 1 < n_it) advance(nh, ni);

        const int stage_off = stage_at(it % SB_STAGES);
        const u32 st = base + stage_off;
        // rows_at(it % SB_STAGES), formed from stage_off (formed apart, d=128 causal soft-capped spilled 16 bytes)
        const float4* stats_s = reinterpret_cast<const float4*>(smem + stage_off + (ROWS0 - STAGE0) +
                                                                (it % SB_STAGES) * (ROWS_BYTES - STAGE_BYTES));
        const float s_do = a.do_scale[seq.q_block0(h) + i];
        mbarrier_wait(base + rows_at(it % SB_STAGES) + SBAR, (it / SB_STAGES) & 1);  // stage `it` is in
        const int q0 = i * BQ;
        if (!WS && SB_WINDOW && SB_DETERMINISTIC && tid == REDUCER) turn_s[it & 1] = dq_turn(j, q0, CTA_KEYS, seq);
        const int ftid = loop_tid();
        const int key0 = j * CTA_KEYS + loop_wg() * BKV;  // the warpgroup's first key
        const int fkey_lo = key0 + (ftid >> 5 & 3) * 16 + (ftid >> 2 & 7);
        // The lengths from the parameters, not through seq: the same values, but through seq ptxas spills 8
        // bytes of the d=128 causal fine kernels at their 255 registers.
        const bool need_mask = q0 + BQ > (SB_VARLEN ? seq.len_q() : a.Lq) || key0 + BKV > (SB_VARLEN ? seq.len_k() : a.Lk) ||
                               (SB_CAUSAL && key0 + BKV - 1 > q0 + hi) ||
                               (SB_WINDOW && key0 + a.win_width < q0 + BQ - 1 + hi);  // a window's left edge

        // Sᵀ and dPᵀ of the warpgroup's 64 keys x the 64 queries, issued together; dPᵀ runs during the softmax. (The
        // soft-capped wide kernels issue dPᵀ once Pᵀ is formed: its registers in flight beside the softmax's spilled.)
        constexpr bool DP_AFTER_P = WIDE_SOFTCAP;
        float p[NT_Q][4], ds[NT_Q][4];
        // dPᵀ from the descriptors' low words of the warpgroup's V rows and of dO.
        auto issue_dp = [&](u32 v_desc, u32 do_desc) {
            if (DP_AFTER_P) wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KS16; ++ks)
                if (!SKIP_PADDING || ks == 0 || 16 * ks < a.Dv)
                    wgmma_f16_ss<SB_BF16>(ds, wgmma_desc<128>(v_desc, kstep_offset<2 * DPV, CTA_KEYS>(ks)),
                                          wgmma_desc<128>(do_desc, kstep_offset<2 * DPV, BQ>(ks)), ks);
            wgmma_commit();
        };
        {
            int s[NT_Q][4];
            wgmma_fence();
            const u32 q_desc = wgmma_desc_lo<DP>(st + SQ), do_desc = wgmma_desc_lo<128>(st + SDO);
            // The warpgroup's K̂ and V rows.
            const int kwg = loop_wg();
            const u32 k_desc = wgmma_desc_lo<DP>(sK) + kwg * BKV * KROW / 16, v_desc = wgmma_desc_lo<128>(sV) + kwg * BKV * 128 / 16;
#pragma unroll
            for (int ks = 0; ks < KS8; ++ks)
                if (!SKIP_PADDING || ks == 0 || 32 * ks < a.D)
                    wgmma_s8_ss(s, wgmma_desc<DP>(k_desc, kstep_offset<DP, CTA_KEYS>(ks)), wgmma_desc<DP>(q_desc, kstep_offset<DP, BQ>(ks)), ks);
            wgmma_commit();
            if (!DP_AFTER_P) issue_dp(v_desc, do_desc);
            if (!WS && tid == REDUCER && it > 0) reduce_dq(it - 1);  // the previous query block's partial is in its tile
            if (DP_AFTER_P) wgmma_wait<0>(); else wgmma_wait<1>();
            wgmma_hold_all(s);

            // Pᵀ = exp2((Sᵀ·s_K)·s_Q (+ bias) - LSE2), masked past the ends and above the diagonal.
            float bias_row[2] = {0.f, 0.f};
            if (SB_BIAS) {
                const float* bp = a.bias + (seq.q_block0(h) + i) * seq.nk_pad();
                bias_row[0] = bp[fkey_lo];
                bias_row[1] = bp[fkey_lo + 8];
            }
            probabilities(p, s, s_k, bias_row, stats_s, 0, t, fkey_lo, q0, need_mask, seq, hi);
        }
        if (DP_AFTER_P) issue_dp(wgmma_desc_lo<128>(sV) + loop_wg() * BKV * 128 / 16, wgmma_desc_lo<128>(st + SDO));

        // P̂ᵀ per key (fine: inside the warp) or per 64x64 block (paper: over the warpgroup).
        u32 pf[2][4];
        float fac_v[2];
        {
            float m_row[2];
            row_max<false>(m_row, p);
            if (!SB_FINE) {
                const float m = warp_max(max_nan(m_row[0], m_row[1]));
                if (lane == 0) red[RED_TILE + warp] = m;
                named_barrier<128>(1 + loop_wg());  // barrier 1 + wg
                float mt = red[RED_TILE + 4 * wg];
#pragma unroll
                for (int w = 1; w < 4; ++w) mt = max_nan(mt, red[RED_TILE + 4 * wg + w]);
                m_row[0] = m_row[1] = mt;
            }
            const Psi p0 = SB_FINE ? psi_unsigned(m_row[0]) : psi(m_row[0]);
            const Psi p1 = SB_FINE ? psi_unsigned(m_row[1]) : psi(m_row[1]);
            const float inv_p[2] = {p0.inv, p1.inv};
            fac_v[0] = p0.scale * s_do;
            fac_v[1] = p1.scale * s_do;
            pack_a(pf[0], p, inv_p, 0);
            pack_a(pf[1], p, inv_p, 4);
        }

        // dSᵀ = Pᵀ ∘ (dPᵀ - δ), in dPᵀ's registers.
        wgmma_wait<0>();
        wgmma_hold_all(ds);
        ds_from_dp(ds, p, stats_s, 0, t, a);
        if (SPLIT) {
            // Part 0 read: every thread releases its own reads (THREADS arrivals). The barrier's address from
            // stats_s, which is live here: formed from base, the soft-capped kernels spilled 24 bytes (NVRTC 13.5).
            mbarrier_arrive(smem_u32(stats_s) + SBAR_EMPTY);
            mbarrier_wait(base + rows_at(it % SB_STAGES) + SBAR_FULL1, (it / SB_STAGES) & 1);  // part 1 is in
        }

        // dV += P̂ᵀ dÔ, one chunk at a time, in flight while dS's maxima are formed.
        const u32 sdot_lo = wgmma_desc_lo<BQ>(st + SDOT), sqt_lo = wgmma_desc_lo<BQ>(st + SQT);
        int pr[NT_CH][4], pr2[NT_CH][4];  // pr2: dK's odd chunks where they pair up (below)
        rows_issue<SB_FINE>(pr, pf, sdot_lo, 0);
        // Later chunks one at a time between the steps below: step c folds chunk c - 1 and issues chunk c.
        auto dv_step = [&](int c) {
            if (c > CHUNKS_V) return;
            wgmma_wait<0>();
            rows_finish(dv[c - 1], pr, pf, fac_v);
            if (c < CHUNKS_V) rows_issue<SB_FINE>(pr, pf, sdot_lo, c);
        };

        // Maxima of |dS| per key (Ẑ, for dK), inside the warp, and per query (Ŷ, for dQ) over the
        // warpgroup's 64 keys; or each one's block max (paper).
        float z_row[2];
        row_max<true>(z_row, ds);
        {
            float colmax[2][8];  // |dS| of column 32x + (y/2)·8 + 2t + y%2, over this thread's 2 keys
#pragma unroll
            for (int x = 0; x < 2; ++x)
#pragma unroll
                for (int y = 0; y < 8; ++y) {
                    const int n = 4 * x + y / 2, c = y % 2;
                    colmax[x][y] = max_nan(fabsf(ds[n][c]), fabsf(ds[n][2 + c]));
                }
            if (SB_FINE) {
#pragma unroll
                for (int x = 0; x < 2; ++x) red[RED_Y + warp * BQ + 32 * x + ycol()] = spread_max8(colmax[x], g);
            } else {
                float my = 0.f;
#pragma unroll
                for (int x = 0; x < 2; ++x)
#pragma unroll
                    for (int y = 0; y < 8; ++y) my = max_nan(my, colmax[x][y]);
                const float mz = warp_max(max_nan(z_row[0], z_row[1]));
                my = warp_max(my);
                if (lane == 0) {
                    red[RED_TILE + 4 * GROUPS + warp] = mz;
                    red[RED_TILE + 8 * GROUPS + warp] = my;
                }
            }
        }
        named_barrier<128>(1 + loop_wg());  // barrier 1 + wg: the warpgroup's Y (or tile) maxima are in
        Psi dk_psi[2], tile_y_psi = {1.f, 0.f};
        if (SB_FINE) {
            dk_psi[0] = psi(z_row[0]);
            dk_psi[1] = psi(z_row[1]);
        } else {
            float mz = red[RED_TILE + 4 * GROUPS + 4 * wg], my = red[RED_TILE + 8 * GROUPS + 4 * wg];
#pragma unroll
            for (int w = 1; w < 4; ++w) {
                mz = max_nan(mz, red[RED_TILE + 4 * GROUPS + 4 * wg + w]);
                my = max_nan(my, red[RED_TILE + 8 * GROUPS + 4 * wg + w]);
            }
            dk_psi[0] = dk_psi[1] = psi(mz);
            tile_y_psi = psi(my);
        }

        dv_step(1);

        // Ŷ for dQ, stored [query][key of the CTA]; per query (fine) or the block's scale (paper).
        // In two halves of 32 queries (x), each followed by a dV step. Fine: lane (g, t) forms the scale
        // of query column 32x + ycol() and each thread gathers the inverse scales of its 8 columns of the
        // half by shuffles.
        {
            // Query row n·8 + 2t + c has swizzle key 2t + c whatever n (swizzled_offset<128, true>), so
            // two offsets and immediates address all 32 bytes (16 offsets would not stay in registers).
            // The warp's 16 keys in Ŷ's 128-key block.
            const int ychunk = 4 * wg + wv;
            const int y_off[2] = {swizzled_offset<128, true>(2 * t, ychunk) + g, swizzled_offset<128, true>(2 * t + 1, ychunk) + g};
            const int yc = ycol();
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                Psi ys = tile_y_psi;
                if (SB_FINE) {
                    float m = red[RED_Y + 4 * wg * BQ + 32 * x + yc];
#pragma unroll
                    for (int w = 1; w < 4; ++w) m = max_nan(m, red[RED_Y + (4 * wg + w) * BQ + 32 * x + yc]);
                    ys = psi(m);
                }
                if (wv == 0)  // Ŷ's factor: its scale times K̂ᵀ's of the warpgroup's key block
                    yscale_s[wg * BQ + 32 * x + yc] = ys.scale * a.kt_scale[seq.k_block0(hk) + j * GROUPS + wg];
#pragma unroll
                for (int n = 4 * x; n < 4 * x + 4; ++n)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float inv = SB_FINE ? __shfl_sync(0xffffffffu, ys.inv, (2 * (n % 4) + c) * 4 + t) : ys.inv;
#pragma unroll
                        for (int half = 0; half < 2; ++half)
                            ds_tile[y_off[c] + n * 8 * 128 + 8 * half] =
                                static_cast<i8>(quant_byte(ds[n][2 * half + c], inv) & 0xffu);
                    }
                dv_step(2 + x);
            }
        }

        // Q-smoothing's exact dK term needs colsum(dS) per key from the FP32 dS.
        float rs[2] = {0.f, 0.f};
        if (SB_BIAS) row_sum(rs, ds);

        // Ẑᵀ for dK, packed in registers.
        u32 zf[2][4];
        const float fac_k[2] = {dk_psi[0].scale, dk_psi[1].scale};  // times Q̂ᵀ's scale, in fold_dk
        {
            const float inv_d[2] = {dk_psi[0].inv, dk_psi[1].inv};
            pack_a(zf[0], ds, inv_d, 0);
            pack_a(zf[1], ds, inv_d, 4);
        }

        dv_step(4);
        rows_issue<false>(pr, zf, sqt_lo, 0);  // dK, chunk 0
        cp_async_wait<0>();   // K̂ᵀ is in (a no-op after the first iteration)
        fence_proxy_async();  // Ŷ's stores, and K̂ᵀ's copies, are read by wgmma
        if (!WS && tid == REDUCER) bulk_wait_read<0>();  // the dQ tile may be rewritten after the barrier
        if (WS && it >= DQ_TILES)  // the partial this tile held last has been read
            mbarrier_wait(base + dq_empty_bar(it % DQ_TILES), (it / DQ_TILES - 1) & 1);
        compute_sync();  // both warpgroups' Ŷ and scales are in shared memory

        // dQ's head-dim slice wg: Σ over the key blocks kb of ŷ_kb[query]·(Ŷ_kb K̂_kb), in column chunks of
        // DQ_CHUNK_COLS: each chunk's int32 products of every key block are in flight at once and fold in one
        // pass, Σ_kb float(Ŷ_kb K̂_kb)·ŷ_kb (I2FP, FMUL or FFMA), into one store to the shared dQ tile. dK's
        // chunks interleave with them.
        {
            int pq[GROUPS][DQ_CHUNK_NT][4];
            // This thread's rows and columns.
            const int ft = loop_tid(), fw = loop_wg(), rows = (ft >> 5 & 3) * 16 + (ft >> 2 & 7);
            const int col0 = dq_col0(fw);  // the first column of the slice
            float* dq_row = reinterpret_cast<float*>(smem + DQ_OFF + (it % DQ_TILES) * DQ_TILE_BYTES) + rows * DQ_TILE_PITCH +
                            col0 + 2 * (ft & 3);
            const u32 kt_lo = kt_desc + col0 * 128 / 16;  // K̂ᵀ rows of the slice
            auto issue_dq = [&](int c) {
                wgmma_fence();
#pragma unroll
                for (int kb = 0; kb < GROUPS; ++kb) {
                    const int in = 64 * kb, kt_col = c * DQ_CHUNK_COLS * 128 / 16;  // key block kb's offset in Ŷ, K̂ᵀ's rows
#pragma unroll
                    for (int kk = 0; kk < 2; ++kk)
                        wgmma_s8_ss(pq[kb], wgmma_desc<128>(ds_desc, in + 32 * kk), wgmma_desc<128>(kt_lo + kt_col, in + 32 * kk), kk);
                }
                wgmma_commit();
            };
            auto fold_dq = [&](int c) {
#pragma unroll
                for (int kb = 0; kb < GROUPS; ++kb) wgmma_hold_all(pq[kb]);
                float f[GROUPS][2];
#pragma unroll
                for (int kb = 0; kb < GROUPS; ++kb) f[kb][0] = yscale_s[kb * BQ + rows], f[kb][1] = yscale_s[kb * BQ + rows + 8];
#pragma unroll
                for (int n = 0; n < DQ_CHUNK_NT; ++n) {
                    const int col = c * DQ_CHUNK_COLS + 8 * n;
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        float2 x = make_float2(static_cast<float>(pq[0][n][2 * half]) * f[0][half],
                                               static_cast<float>(pq[0][n][2 * half + 1]) * f[0][half]);
#pragma unroll
                        for (int kb = 1; kb < GROUPS; ++kb) {
                            x.x = fmaf(static_cast<float>(pq[kb][n][2 * half]), f[kb][half], x.x);
                            x.y = fmaf(static_cast<float>(pq[kb][n][2 * half + 1]), f[kb][half], x.y);
                        }
                        *reinterpret_cast<float2*>(dq_row + half * 8 * DQ_TILE_PITCH + col) = x;
                    }
                }
            };
            // Products in the order dK 0, dQ 0, dK 1, dQ 1, ..., then dK's last chunks, two in flight: each one
            // is issued once the one two before it is folded. Where dK has two or more chunks after dQ's last,
            // odd dK chunks accumulate in pr2, so that those run two at a time once dQ's registers are free.
            static_assert(DQ_CHUNKS <= CHUNKS, "dQ's chunks interleave with dK's");
            constexpr int PRODUCTS = CHUNKS + DQ_CHUNKS;
            constexpr bool DK_PAIRS = CHUNKS - DQ_CHUNKS >= 2;
            // Product x: a dQ chunk (odd x below 2·DQ_CHUNKS) or a dK chunk; its chunk index.
            auto is_dq = [](int x) { return x < 2 * DQ_CHUNKS && x % 2 == 1; };
            auto chunk_of = [](int x) { return x < 2 * DQ_CHUNKS ? x / 2 : x - DQ_CHUNKS; };
            auto issue = [&](int x) {
                const int c = chunk_of(x);
                if (is_dq(x))
                    issue_dq(c);
                else
                    rows_issue<false>(DK_PAIRS && c % 2 ? pr2 : pr, zf, sqt_lo, c);
            };
            issue(1);  // dK 0 is in flight already
#pragma unroll
            for (int x = 0; x < PRODUCTS; ++x) {
                if (x + 1 < PRODUCTS) wgmma_wait<1>(); else wgmma_wait<0>();  // product x is done (x + 1 may run)
                const int c = chunk_of(x);
                if (is_dq(x)) {
                    fold_dq(c);
                } else {
                    // Q̂ᵀ's scale of the query block (stats' fourth slot), read here from an address formed
                    // here: held longer, or through stats_s, d=128 with Q-smoothing spilled
                    const float s_qt = SPLIT || SB_SOFTCAP
                                           ? reinterpret_cast<const float4*>(smem + rows_at(SPLIT ? 0 : it % SB_STAGES) + SBAR_STATS1)->w
                                           : stage_rows(it % SB_STAGES)[0].w;
                    const float fk[2] = {fac_k[0] * s_qt, fac_k[1] * s_qt};
                    fold_dk(c, DK_PAIRS && c % 2 ? pr2 : pr, zf, fk);
                }
                if (x + 2 < PRODUCTS) issue(x + 2);
            }
            fence_proxy_async();  // the bulk reduction reads what these stores wrote
            // dq_acc spans Nq_pad rows: padded rows and columns take (zero) updates.
            pending_row = seq.q_row0(h) + q0;
            if (WS) {  // the partial is in its tile, and the stage has been read (the dK products are done)
                __syncwarp();
                if (PASSES > 1 && fresh_tid() == 0) turn_s[it % DQ_TILES] = static_cast<int>(pending_row);
                if ((fresh_tid() & 31) == 0) mbarrier_arrive(base + dq_full_bar(it % DQ_TILES));  // (a fresh lane: one
                                                                                          // held across the loop spilled)
                // The stage: every thread arrives (THREADS of them), releasing its own reads of the statistics.
                mbarrier_arrive(base + rows_at(it % SB_STAGES) + (SPLIT ? SBAR_EMPTY1 : SBAR_EMPTY));
            }
        }

        if (SB_BIAS) {
            // Q-smoothing's exact dK term colsum(dS)ᵀ ⊗ μ_Q.
            const float* mu = a.q_mean + (seq.q_block0(h) + i) * DP;
#pragma unroll
            for (int ch = 0; ch < CHUNKS; ++ch)
#pragma unroll
                for (int n = 0; n < NT_CH; ++n) {
                    const int col = ch * CHUNK_COLS + n * 8 + 2 * t;
                    const float m0 = mu[col], m1 = mu[col + 1];
                    dk[ch][n][0] = fmaf(rs[0], m0, dk[ch][n][0]);
                    dk[ch][n][1] = fmaf(rs[0], m1, dk[ch][n][1]);
                    dk[ch][n][2] = fmaf(rs[1], m0, dk[ch][n][2]);
                    dk[ch][n][3] = fmaf(rs[1], m1, dk[ch][n][3]);
                }
        }
    }

    cp_async_wait<0>();  // (no iteration waited for K̂ᵀ where there was none)
    if (!WS && pending_row >= 0) {  // (n_it > 0, as a value the loop holds anyway: a predicate held across it spilled)
        __syncthreads();       // the last query block's dQ partial is in shared memory
        if (tid == REDUCER) {
            reduce_dq(n_it - 1);
            bulk_wait_read<0>();  // the tile is read; the writes land before the kernel ends
        }
    }

    // dK (factor ln 2: Q̂ holds c·log2(e)·Q) and dV of this thread's keys, in the input dtype. The
    // thread's key and columns come from a fresh index: the compiler would otherwise form them (and the
    // column predicates) before the loop and hold them across it.
    const int ft = fresh_tid(), ft_t = ft & 3;
    const int fpass = fresh_pass();
    // The CTA's cell formed again in the narrow dense kernels: held across the loop, d=192's causal one spilled 8 bytes.
    constexpr bool FRESH_CELL = DQK < DP && !SB_VARLEN;
    const GridCell fc = FRESH_CELL ? backward_cell(a.grid_order) : GridCell{j * PASSES, hk, b};
    const int fj = fc.j / PASSES, fhk = fc.hk;
    const BackwardSeq fseq = FRESH_CELL ? BackwardSeq(a, fc.b) : seq;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = fj * CTA_KEYS + (ft >> 5) * 16 + (ft >> 2 & 7) + 8 * half;  // key_lo + 8·half
        if (key >= fseq.len_k()) continue;
        u16* kr = a.dk + fseq.key_token(a.kb, a.kh, a.kn, fhk, key);
        u16* vr = a.dv + fseq.key_token(a.wb, a.wh, a.wn, fhk, key);
#pragma unroll
        for (int ch = 0; ch < CHUNKS; ++ch)
#pragma unroll
            for (int n = 0; n < NT_CH; ++n) {
                const int col = fpass * DH + ch * CHUNK_COLS + n * 8 + 2 * ft_t;
                const int vcol = fpass * DHV + ch * CHUNK_COLS + n * 8 + 2 * ft_t;  // (col where DHV = DH)
                if (col < a.D) {
                    const float k0 = dk[ch][n][2 * half], k1 = dk[ch][n][2 * half + 1];
                    *reinterpret_cast<u32*>(kr + col) = pack2_f32<SB_BF16>(k0 * 0.6931471805599453f, k1 * 0.6931471805599453f);
                }
                if (ch < CHUNKS_V && vcol < a.Dv)
                    *reinterpret_cast<u32*>(vr + vcol) = pack2_f32<SB_BF16>(dv[ch][n][2 * half], dv[ch][n][2 * half + 1]);
            }
    }
}
