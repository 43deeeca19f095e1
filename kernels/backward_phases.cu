// SageBwd backward on Hopper (sm_90a) at MLA's 192/128: backward_pair.cu's CTA of 64 keys and its numerics, with the
// two warpgroups specialized by phase instead of splitting each phase in halves.
//   warpgroup 0 (scores): Sᵀ and dPᵀ of the 64 keys x the block's 64 queries (m64n64), Pᵀ and dSᵀ, P̂ᵀ and Ẑᵀ per key
//   (its rows hold every query: no exchange), Ŷ per query over the 64 keys (through shared memory, inside the
//   warpgroup); the codes, Ŷ's and the per-key factors go to one of two code slots. The next iteration's Sᵀ and dPᵀ
//   go out once this one's dSᵀ is formed.
//   warpgroup 1 (gradients): dV, dK and dQ of every column from a slot's codes, one iteration behind, in n64 products
//   two in flight; dQ's partial through one shared tile, a TMA reduction for each 64-column product's part once it
//   is stored (the part's last reduction only has to have read its own part before it is rewritten).
// In pair's kernel both warpgroups run each phase at once, held in step by three CTA barriers an iteration; here they
// wait for each other only through mbarriers: a slot's codes full (scores -> gradients), the slot empty (gradients ->
// scores), and each stage's two halves of TMA loads, Q̂, dO and the statistics (the scores') and Q̂ᵀ and dÔᵀ (the
// gradients'), each reloaded for the iteration after next by the warpgroup that reads it once it has. dK and dV are
// pair's bit for bit (the same integer products, folded in the same order).
// The 192/128 default (docs/PERFORMANCE.md: 1.03-1.12x pair's kernel once dQ went out a 64-column part at a time; with
// one reduction of the whole tile, the gradients waited for it to have read the tile and the kernel ran 0.89-0.93x).
//
// Compile-time parameters: pair's (SB_DP 256, SB_DQK, SB_DPV <= 128, SB_BF16, SB_CAUSAL, SB_WINDOW, SB_VARLEN; fine
// granularity, no Q-smoothing, soft cap or deterministic order); from specs.BackwardTiles.implied: SB_THREADS (256),
// SB_CTA_KEYS (64), SB_KEY_PAD, SB_DQ_PITCH (DQK: dq_acc rows without padding) and the query-side tensor maps' boxes
// (dQ's: a product's 64 columns as two 32-column blocks in the 128-byte swizzle).
#include "backward_halves.cuh"
#include "wgmma.cuh"
#include "bulk.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "tma.cuh"

constexpr int DP = SB_DP;
constexpr int DQK = SB_DQK, DPV = SB_DPV;
constexpr int BQ = SB_BLOCK_Q, BKV = SB_BLOCK_KV;
constexpr int CTA_KEYS = SB_CTA_KEYS, THREADS = SB_THREADS;
static_assert(DP == 256 && BQ == 64 && BKV == 64 && CTA_KEYS == BKV && THREADS == 256, "two warpgroups, 64 keys");
static_assert(SB_FINE && !SB_BIAS && !SB_SOFTCAP && !SB_DETERMINISTIC,
              "fine granularity, no Q-smoothing, no soft cap, not deterministic");
static_assert(DQK % 64 == 0 && DQK <= DP && DPV % 64 == 0 && DPV <= 128 && DPV <= DQK,
              "n64 products; two whole stages (V's head dim at most 128)");
constexpr int NT = BQ / 8;          // n-tiles of Sᵀ and dPᵀ (every query of the block)
constexpr int NK = DQK / 8, NV = DPV / 8;  // dK's (and dQ's) and dV's n-tiles
constexpr int CHUNK = 8;            // n-tiles a gradient product (m64n64)
constexpr int KS8 = DQK / 32;       // Sᵀ's INT8 k-steps (those past the head dim D are skipped)
constexpr int KS16 = DPV / 16;      // dPᵀ's 16-bit k-steps (those past V's head dim Dv are skipped)
constexpr int DQ_PITCH = SB_DQ_PITCH;
constexpr int DQ_BLOCK = SB_TMA_DQ_COLS;  // dQ's tile: blocks of 32 f32 columns x 64 rows (128-byte rows, swizzled)
static_assert(DQ_PITCH == DQK && DQ_BLOCK == 32 && SB_TMA_DQ_BLOCKS * DQ_BLOCK == CHUNK * 8,
              "tm_dq's box is a 64-column product's part of the dQ tile, dq_acc's rows unpadded");
static_assert(SB_TMA_QROWS == BQ && SB_TMA_Q_COLS == 128 && SB_TMA_QT_ROWS == DQK && SB_TMA_DOT_ROWS == DPV &&
              SB_TMA_DO_COLS == 64, "Q̂ a query block's column blocks; Q̂ᵀ and dÔᵀ every row; dO 64-column boxes");
static_assert(SB_TMA_SWIZZLE_Q == 128 && SB_TMA_SWIZZLE_QT == 64 && SB_TMA_SWIZZLE_DO == 128, "each box in its rows' swizzle");

struct PhaseStage {
    i8 q[BQ * DP];        // Q̂   [64 q][DP] int8, 128-byte column blocks
    u16 dout[BQ * DPV];   // dO  [64 q][DPV] 16-bit, 128-byte column blocks
    i8 qt[DQK * BQ];      // Q̂ᵀ  [DQK][64 q] int8, fragment token order
    i8 dot[DPV * BQ];     // dÔᵀ [DPV][64 q] int8, fragment token order
};
struct CodeSlot {
    i8 pt[BKV * BQ];      // P̂ᵀ [64 keys][64 q] u8, 64-byte rows in fragment token order
    i8 zt[BKV * BQ];      // Ẑᵀ, the same
    i8 ds[BQ * BKV];      // Ŷ  [64 q][64 keys]
};
struct PhaseShared {
    i8 k[BKV * DP];                 // K̂  [64 keys][DP], 128-byte column blocks
    i8 kt[DQK * BKV];               // K̂ᵀ [DQK][64 keys]
    u16 v[BKV * DPV];               // V  [64 keys][DPV] 16-bit, 128-byte column blocks
    PhaseStage stage[2];
    CodeSlot code[2];
    float dq[DQK * BQ];             // dQ's partial tile: [DQK/32 column blocks][64 q][32], swizzled
    float4 stats[2][BQ];            // (LSE2, s_Q, δ, s_Qᵀ) per query of each stage
    float fac[2][2][BKV];           // [slot][dV or dK][key]: the folds' factors (P̂ᵀ's scale·s_dO, Ẑᵀ's·s_Qᵀ)
    float yscale[2][BQ];            // [slot][query]: Ŷ's factor (its scale times K̂ᵀ's)
    float red_y[2][4][32];          // [query half][warp][query]: per-query maxima of |dS| (halves alternate)
    // each stage's loads: the scores' half (Q̂, dO, statistics) and the gradients' (Q̂ᵀ, dÔᵀ), each warpgroup loading
    // its own half of the iteration after next once it has read it
    unsigned long long q_full[2], g_full[2];
    unsigned long long codes_full[2], codes_empty[2];
};
constexpr int TILE_ALIGN = 1024;
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(PhaseShared) + (TILE_ALIGN - 128);
constexpr int SDO = sizeof(PhaseStage::q), SQT = SDO + sizeof(PhaseStage::dout), SDOT = SQT + sizeof(PhaseStage::qt);
constexpr int STAGE0 = sizeof(PhaseShared::k) + sizeof(PhaseShared::kt) + sizeof(PhaseShared::v);
constexpr int CODE0 = STAGE0 + sizeof(PhaseShared::stage);
constexpr int DQ_OFF = CODE0 + sizeof(PhaseShared::code);
static_assert(sizeof(PhaseShared::k) % TILE_ALIGN == 0 && (STAGE0 - sizeof(PhaseShared::v)) % TILE_ALIGN == 0 &&
              STAGE0 % TILE_ALIGN == 0 && sizeof(PhaseStage) % TILE_ALIGN == 0 && SDO % TILE_ALIGN == 0 &&
              SQT % TILE_ALIGN == 0 && SDOT % TILE_ALIGN == 0 && CODE0 % TILE_ALIGN == 0 &&
              sizeof(CodeSlot) % TILE_ALIGN == 0 && BKV * BQ % TILE_ALIGN == 0 && DQ_OFF % TILE_ALIGN == 0,
              "wgmma tiles and the dQ tile's column blocks on their swizzle atoms");
static_assert(DYNAMIC_SHARED_BYTES <= 232448, "one CTA an SM");
constexpr u32 Q_LOAD_BYTES = SQT + 16 * BQ, G_LOAD_BYTES = sizeof(PhaseStage) - SQT;
constexpr int BAR_SCORES = 1, BAR_GRADS = 2;  // named barriers of each warpgroup (128 threads)
constexpr int LOADER = 128;                    // the gradients' thread that issues their stage loads
constexpr int REDUCER = 160;                   // and the one that issues dQ's reductions (another warp)

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attention_backward(SB_KERNEL_PARAMS(SB_BACKWARD_FIELDS), SB_KERNEL_MAPS(SB_BACKWARD_MAPS)) {
    const BackwardParams a = SB_KERNEL_VIEW(BackwardParams, SB_BACKWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((TILE_ALIGN - smem_u32(smem_raw) % TILE_ALIGN) % TILE_ALIGN);
    PhaseShared& sh = *reinterpret_cast<PhaseShared*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wv = warp & 3;
    const GridCell cell = backward_cell(a.grid_order);
    const int j = cell.j, hk = cell.hk, b = cell.b;
    const int group = a.Hq / a.Hkv;
    const BackwardSeq seq(a, b);
    const int hi = seq.band_hi();
    static_assert(CTA_KEYS == BACKWARD_CTA_KEYS, "backward_common.cuh's key count");
    if (SB_VARLEN && j * CTA_KEYS >= seq.len_k()) return;  // packed: the grid covers the longest sequence
    const QueryBlocks qb = query_blocks(j * CTA_KEYS, CTA_KEYS, seq);
    const int i0 = qb.i0, n_i = qb.n_i, n_it = group * n_i;

    // K̂, V and K̂ᵀ by cp.async, every thread.
    load_key_block<DP, DQK, DPV, THREADS>(smem_u32(sh.k), smem_u32(sh.v), smem_u32(sh.kt), a, seq, hk, j, tid);
    cp_async_commit();

    auto load_grad = [&](int h, int i, int slot) {  // Q̂ᵀ and dÔᵀ
        const u32 st = smem_u32(&sh.stage[slot]), bar = smem_u32(&sh.g_full[slot]);
        mbarrier_arrive_expect_tx(bar, G_LOAD_BYTES);
        const int qt_row = static_cast<int>(seq.qt_row0(h, DP));
        tma_load_2d(st + SQT, tm_qt, seq.qt_col0() + i * BQ, qt_row, bar);
        tma_load_2d(st + SDOT, tm_dot, seq.qt_col0() + i * BQ, qt_row, bar);
    };
    auto load_query = [&](int h, int i, int slot) {  // Q̂, dO and the statistics
        const u32 st = smem_u32(&sh.stage[slot]), bar = smem_u32(&sh.q_full[slot]);
        mbarrier_arrive_expect_tx(bar, Q_LOAD_BYTES);
        tma_load_3d(st, tm_q, 0, static_cast<int>(seq.q_row0(h)) + i * BQ, 0, bar);  // its column blocks in one box
        // Packed: dO is one [1][Hq][total][D] tensor; rows past this sequence's end are the next one's, which
        // padded rows' P = 0 (LSE2 = +inf, δ = 0 there) keeps out of every product.
#pragma unroll
        for (int cb = 0; cb < DPV / 64; ++cb)
            tma_load_4d(st + SDO + cb * BQ * 128, tm_do, 64 * cb, seq.q_start() + i * BQ, h, SB_VARLEN ? 0 : seq.b, bar);
        bulk_load(smem_u32(&sh.stats[slot][0]), a.stats + seq.q_row0(h) + i * BQ, 16 * BQ, bar);
    };
    const int h_first = hk * group, i_last = i0 + n_i - 1;
    // Causal: pair's sweep (backward_wgmma.cu's 128-key CTA j / 2's rotation), so that dK and dV are its bit for bit.
    const int i_start = pair_sweep_start(j, i0, i_last, seq);
    auto advance = [&](int& hh, int& ii) { sweep_advance(hh, ii, h_first, group, i0, i_last); };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            mbarrier_init(smem_u32(&sh.q_full[s]), 1);
            mbarrier_init(smem_u32(&sh.g_full[s]), 1);
            mbarrier_init(smem_u32(&sh.codes_full[s]), 128);
            mbarrier_init(smem_u32(&sh.codes_empty[s]), 128);
        }
        fence_mbarrier_init();
        prefetch_tensor_map(tm_q);
        prefetch_tensor_map(tm_qt);
        prefetch_tensor_map(tm_dot);
        prefetch_tensor_map(tm_do);
        prefetch_tensor_map(tm_dq);
        int h = h_first, i = i_start;
        for (int s = 0; s < 2 && s < n_it; ++s, advance(h, i)) {
            load_query(h, i, s);
            load_grad(h, i, s);
        }
    }
    cp_async_wait<0>();
    fence_proxy_async();  // cp.async wrote K̂, V and K̂ᵀ, which the async proxy reads
    __syncthreads();      // and the mbarriers are initialized

    const int krow = wv * 16 + g;  // this thread's key rows: krow, krow + 8
    const int key0 = j * CTA_KEYS;
    if (warpgroup_uniform() == 0) {
        // ---- Scores: Sᵀ, dPᵀ, the softmax, dSᵀ and the codes of iteration it into slot it & 1. The next iteration's
        // Sᵀ and dPᵀ are issued once this one's dSᵀ is formed, in flight over its codes (two register sets, the loop
        // unrolled by two), and the warpgroup reloads its half of a stage once it has read it.
        float s_k[2];
        {
            const i64 k0 = seq.k_row0(hk) + key0 + krow;
            s_k[0] = a.k_scale[k0];
            s_k[1] = a.k_scale[k0 + 8];
        }
        const float kt_scale = a.kt_scale[seq.k_block0(hk) + j];  // K̂ᵀ's scale of the key block
        auto issue_scores = [&](int slot, int (&s)[NT][4], float (&dp)[NT][4]) {
            const u32 st = smem_u32(&sh.stage[slot]);
            wgmma_fence();
            const u32 k_desc = wgmma_desc_lo<DP>(smem_u32(sh.k));
            const u32 q_desc = wgmma_desc_lo<DP>(st);
#pragma unroll
            for (int ks = 0; ks < KS8; ++ks)
                if (ks == 0 || 32 * ks < a.D)
                    wgmma_s8_ss(s, wgmma_desc<DP>(k_desc, kstep_offset<DP, BKV>(ks)),
                                wgmma_desc<DP>(q_desc, kstep_offset<DP, BQ>(ks)), ks);
            const u32 v_desc = wgmma_desc_lo<128>(smem_u32(sh.v));
            const u32 do_desc = wgmma_desc_lo<128>(st + SDO);
#pragma unroll
            for (int ks = 0; ks < KS16; ++ks)
                if (ks == 0 || 16 * ks < a.Dv)
                    wgmma_f16_ss<SB_BF16>(dp, wgmma_desc<128>(v_desc, kstep_offset<2 * DPV, BKV>(ks)),
                                          wgmma_desc<128>(do_desc, kstep_offset<2 * DPV, BQ>(ks)), ks);
            wgmma_commit();
        };
        int h = h_first, i = i_start, lh = h_first, li = i_start;  // this iteration's block, and the load's
        advance(lh, li);
        advance(lh, li);  // (the iteration after next: the prologue loaded two)
        // Iteration it, its Sᵀ and dPᵀ issued into (s, dp); the next one's go to (s2, dp2).
        auto step = [&](int it, int (&s)[NT][4], float (&dp)[NT][4], int (&s2)[NT][4], float (&dp2)[NT][4]) {
            const int slot = it & 1;
            const float s_do = a.do_scale[seq.q_block0(h) + i];
            const float4* stats_s = sh.stats[slot];
            const int q0 = i * BQ;
            const bool need_mask = q0 + BQ > (SB_VARLEN ? seq.len_q() : a.Lq) ||
                                   key0 + BKV > (SB_VARLEN ? seq.len_k() : a.Lk) ||
                                   (SB_CAUSAL && key0 + BKV - 1 > q0 + hi) ||
                                   (SB_WINDOW && key0 + a.win_width < q0 + BQ - 1 + hi);
            float p[NT][4];
            wgmma_wait<0>();  // this iteration's Sᵀ and dPᵀ (issued by the last one, or the prologue)
            wgmma_hold_all(s);
            wgmma_hold_all(dp);
            const float no_bias[2] = {0.f, 0.f};
            probabilities(p, s, s_k, no_bias, stats_s, 0, t, key0 + krow, q0, need_mask, seq, hi);
            float m[4];  // per key (rows krow, krow + 8): the maxima of Pᵀ and |dSᵀ| over the block's 64 queries
            {
                float mp[2];
                row_max<false>(mp, p);
                m[0] = mp[0];
                m[1] = mp[1];
            }
            float(&ds)[NT][4] = dp;
            ds_from_dp(ds, p, stats_s, 0, t, a);
            {
                float mz[2];
                row_max<true>(mz, ds);
                m[2] = mz[0];
                m[3] = mz[1];
            }
            const float s_qt = stats_s[0].w;  // Q̂ᵀ's scale of the query block
            // Every thread has read the slot's Q̂, dO (the products are done) and statistics: the slot takes the
            // iteration after next, and the next iteration's products go out (its slot loaded an iteration ago).
            named_barrier<128>(BAR_SCORES);
            if (it + 2 < n_it) {
                if (tid == 0) load_query(lh, li, slot);
                advance(lh, li);
            }
            if (it + 1 < n_it) {
                mbarrier_wait(smem_u32(&sh.q_full[slot ^ 1]), ((it + 1) >> 1) & 1);
                issue_scores(slot ^ 1, s2, dp2);
            }
            if (it >= 2) mbarrier_wait(smem_u32(&sh.codes_empty[slot]), ((it >> 1) & 1) ^ 1);  // iteration it - 2's read
            CodeSlot& cs = sh.code[slot];
            {  // P̂ᵀ (unsigned codes) and Ẑᵀ per key, with the folds' factors
                const Psi p0 = psi_unsigned(m[0]), p1 = psi_unsigned(m[1]), z0 = psi(m[2]), z1 = psi(m[3]);
                const float inv_p[2] = {p0.inv, p1.inv}, inv_z[2] = {z0.inv, z1.inv};
                if (t == 0) {
                    sh.fac[slot][0][krow] = p0.scale * s_do;
                    sh.fac[slot][0][krow + 8] = p1.scale * s_do;
                    sh.fac[slot][1][krow] = z0.scale * s_qt;
                    sh.fac[slot][1][krow + 8] = z1.scale * s_qt;
                }
#pragma unroll
                for (int qh = 0; qh < 2; ++qh) {
                    store_half_codes(cs.pt, reinterpret_cast<const float(&)[HALF_NT][4]>(p[HALF_NT * qh]), inv_p, krow, qh, t);
                    store_half_codes(cs.zt, reinterpret_cast<const float(&)[HALF_NT][4]>(ds[HALF_NT * qh]), inv_z, krow, qh, t);
                }
            }
            // Ŷ per query over the 64 keys, stored [query][key] in 64-byte rows (the warp's keys: chunk wv), a half of
            // the queries at a time (each half's maxima buffer is rewritten only after the other half's barrier).
#pragma unroll
            for (int qh = 0; qh < 2; ++qh) {
                const float(&dsh)[HALF_NT][4] = reinterpret_cast<const float(&)[HALF_NT][4]>(ds[HALF_NT * qh]);
                int yc;
                const Psi ys = half_query_psi(dsh, sh.red_y, qh, wv, g, t, BAR_SCORES, yc);
                if (wv == 0) sh.yscale[slot][HALF_Q * qh + yc] = ys.scale * kt_scale;
                store_half_y<64>(cs.ds, dsh, ys.inv, wv, qh, g, t);
            }
            fence_proxy_async();  // the codes and Ŷ are read by wgmma
            mbarrier_arrive(smem_u32(&sh.codes_full[slot]));
            advance(h, i);
        };
        int sa[NT][4], sb[NT][4];
        float da[NT][4], db[NT][4];
        if (n_it > 0) {
            mbarrier_wait(smem_u32(&sh.q_full[0]), 0);
            issue_scores(0, sa, da);
        }
        int it = 0;
        for (; it + 1 < n_it; it += 2) {  // (every path into the loop's top with Sᵀ and dPᵀ in flight in (sa, da))
            step(it, sa, da, sb, db);
            step(it + 1, sb, db, sa, da);
        }
        if (it < n_it) step(it, sa, da, sb, db);
        return;
    }

    // ---- Gradients: dV, dK and dQ of iteration it from slot it & 1, then the stage load of iteration it + 2.
    // Keys krow, krow + 8 x columns 8n + 2t, +1.
    float dk[NK][4], dv[NV][4];
#pragma unroll
    for (int n = 0; n < NK; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dk[n][e] = 0.f;
            if (n < NV) dv[n][e] = 0.f;
        }
    const int gt = tid - 128;
    const int rows = (gt >> 5) * 16 + (gt >> 2 & 7);  // this thread's dQ rows: rows, rows + 8
    for (int it = 0; it < n_it; ++it) {
        const int slot = it & 1;
        mbarrier_wait(smem_u32(&sh.codes_full[slot]), (it >> 1) & 1);
        mbarrier_wait(smem_u32(&sh.g_full[slot]), (it >> 1) & 1);
        const CodeSlot& cs = sh.code[slot];
        const u32 st = smem_u32(&sh.stage[slot]);
        const u32 pt_lo = wgmma_desc_lo<64>(smem_u32(cs.pt)), zt_lo = wgmma_desc_lo<64>(smem_u32(cs.zt));
        const u32 ds_lo = wgmma_desc_lo<64>(smem_u32(cs.ds));
        const u32 dot_lo = wgmma_desc_lo<64>(st + SDOT), qt_lo = wgmma_desc_lo<64>(st + SQT);
        const u32 kt_lo = wgmma_desc_lo<64>(smem_u32(sh.kt));
        // The products in n64 chunks, c = 0..NC-1: dV's NV/8, then dK's NK/8, then dQ's NK/8; chunk c + 1 is issued
        // before chunk c is folded.
        constexpr int CV = NV / CHUNK, CK = NK / CHUNK, NC = CV + 2 * CK;
        static_assert(CK >= 2, "dQ in two or more parts");
        int acc[2][CHUNK][4];
        auto issue = [&](int c) {
            int(&d)[CHUNK][4] = acc[c & 1];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                if (c < CV)
                    wgmma_u8s8_ss(d, wgmma_desc<64>(pt_lo, 32 * kk), wgmma_desc<64>(dot_lo + c * CHUNK * 8 * BQ / 16, 32 * kk), kk);
                else if (c < CV + CK)
                    wgmma_s8_ss(d, wgmma_desc<64>(zt_lo, 32 * kk), wgmma_desc<64>(qt_lo + (c - CV) * CHUNK * 8 * BQ / 16, 32 * kk), kk);
                else
                    wgmma_s8_ss(d, wgmma_desc<64>(ds_lo, 32 * kk), wgmma_desc<64>(kt_lo + (c - CV - CK) * CHUNK * 8 * BKV / 16, 32 * kk), kk);
            }
            wgmma_commit();
        };
        // Chunk c's factors per row (dV's and dK's per key, dQ's per query), read before its product is waited for.
        auto factors = [&](int c, float (&f)[2]) {
            const float* src = c < CV ? &sh.fac[slot][0][krow] : c < CV + CK ? &sh.fac[slot][1][krow] : &sh.yscale[slot][rows];
            f[0] = src[0];
            f[1] = src[8];
        };
        auto fold = [&](int c, const float (&f)[2]) {
            int(&d)[CHUNK][4] = acc[c & 1];
            wgmma_hold_all(d);
            if (c < CV) {
                const float(&fac_v)[2] = f;
#pragma unroll
                for (int n = 0; n < CHUNK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dv[c * CHUNK + n][e] = fmaf(static_cast<float>(d[n][e]), fac_v[e >> 1], dv[c * CHUNK + n][e]);
            } else if (c < CV + CK) {
                const float(&fac_k)[2] = f;
#pragma unroll
                for (int n = 0; n < CHUNK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dk[(c - CV) * CHUNK + n][e] = fmaf(static_cast<float>(d[n][e]), fac_k[e >> 1], dk[(c - CV) * CHUNK + n][e]);
            } else {
                // Rows `rows`, +8 (both ≡ g mod 8), columns 8n + 2t, +1 of the product's part: column block n/4 of
                // it, 16-byte chunk (2(n%4) + t/2) XOR g (the 128-byte swizzle), word 2(t%2).
                const float(&fq)[2] = f;
                float* dq_row = sh.dq + (c - CV - CK) * CHUNK * 8 * BQ + rows * DQ_BLOCK + 2 * (t & 1);
                const int swz = (t >> 1) ^ g;
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int n = 0; n < CHUNK; ++n)
                        *reinterpret_cast<float2*>(dq_row + half * 8 * DQ_BLOCK + n / 4 * BQ * DQ_BLOCK +
                                                   4 * ((2 * (n % 4)) ^ swz)) =
                            make_float2(static_cast<float>(d[n][2 * half]) * fq[half],
                                        static_cast<float>(d[n][2 * half + 1]) * fq[half]);
            }
        };
        // dQ's part cc goes to dq_acc's rows from dq_row0 once stored; its reduction a commit group of its own.
        i64 dq_row0 = 0;
        if (tid == REDUCER) {
            int hh, ii;
            sweep_at(it, hh, ii, h_first, group, i0, n_i, i_start);
            dq_row0 = seq.q_row0(hh) + ii * BQ;
        }
        auto reduce_part = [&](int cc) {
            tma_reduce_add_3d(tm_dq, 0, static_cast<int>(dq_row0), SB_TMA_DQ_BLOCKS * cc, smem_u32(sh.dq) + cc * CHUNK * 8 * BQ * 4);
            bulk_commit();
        };
        issue(0);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            float f[2];
            factors(c, f);
            if (c + 1 < NC) {
                issue(c + 1);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            if (c >= CV + CK) {
                // dQ's part cc rewrites its part of the tile: the last iteration's reduction of it has read it (the
                // commit groups after that one: its later parts', and this iteration's before cc - 1, still pending
                // at most). Part cc - 1 is stored: its reduction goes out.
                const int cc = c - CV - CK;
                if (cc > 0) fence_proxy_async();
                if (tid == REDUCER) {
                    if (cc == 0) bulk_wait_read<CK - 1>();
                    else bulk_wait_read<CK - 2>();
                }
                named_barrier<128>(BAR_GRADS);
                if (cc > 0 && tid == REDUCER) reduce_part(cc - 1);
            }
            fold(c, f);
        }
        // The slot's codes and the stage are read: the scores may refill the slot, the stage takes iteration it + 2.
        mbarrier_arrive(smem_u32(&sh.codes_empty[slot]));
        fence_proxy_async();  // the TMA reduction reads the dQ tile's stores
        named_barrier<128>(BAR_GRADS);
        if (tid == LOADER && it + 2 < n_it) {
            int hh, ii;
            sweep_at(it + 2, hh, ii, h_first, group, i0, n_i, i_start);
            load_grad(hh, ii, slot);
        }
        if (tid == REDUCER) reduce_part(CK - 1);
    }
    if (tid == REDUCER && n_it > 0) bulk_wait_read<0>();

    // dK (factor ln 2: Q̂ holds c·log2(e)·Q) and dV (V's head dim Dv of columns) of this thread's keys.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = key0 + krow + 8 * half;
        if (key >= seq.len_k()) continue;
        u16* kr = a.dk + seq.key_token(a.kb, a.kh, a.kn, hk, key);
        u16* vr = a.dv + seq.key_token(a.wb, a.wh, a.wn, hk, key);
#pragma unroll
        for (int n = 0; n < NK; ++n) {
            const int col = n * 8 + 2 * t;
            if (col < a.D)
                *reinterpret_cast<u32*>(kr + col) = pack2_f32<SB_BF16>(dk[n][2 * half] * 0.6931471805599453f,
                                                                       dk[n][2 * half + 1] * 0.6931471805599453f);
            if (n < NV && col < a.Dv) *reinterpret_cast<u32*>(vr + col) = pack2_f32<SB_BF16>(dv[n][2 * half], dv[n][2 * half + 1]);
        }
    }
}
