// SageBwd backward on Hopper (sm_90a) above head dim 128: a CTA of 64 keys (one quantization block) whose two
// computing warpgroups split the query block for the scores and the head dims for the gradients, so that each
// score is formed once. backward_wgmma.cu at these head dims runs two CTAs a key block, each computing every
// score (Sᵀ, dPᵀ, the softmax and the codes) and half of dK, dV and dQ. The numerics are that kernel's
// (quantization blocks of 64 keys x 64 queries, the same scales, codes and products, numerics.py).
//   warpgroup w: Sᵀ and dPᵀ of the 64 keys x queries 32w..32w+31 (m64n32), Pᵀ, dSᵀ; P̂ᵀ and Ẑᵀ per key over the
//   block's 64 queries (the two warpgroups exchange their halves' maxima through shared memory), stored in
//   shared [64 keys][64 q] A tiles; Ŷ per query over the 64 keys (inside the warpgroup), stored [64 q][64 keys].
//   dV of V's columns DHV·w.., dK and dQ of Q·K's columns DH·w.., from the shared codes of both halves.
// The gradient products are one wgmma each (m64n64 for dV, m64n96 for dK and dQ at 192/128), two in flight.
// Barriers an iteration: three of the CTA (the iteration's start; the maxima exchange; the codes and Ŷ of both
// halves before the gradient products) and one of a warpgroup (Ŷ's per-query maxima). Each warpgroup's dQ
// partial goes through a shared f32 tile, blocks of 32 columns x 64 rows in TMA's 128-byte swizzle (no padding
// against bank conflicts, so the reduction adds no zero columns), to one TMA reduction into dq_acc, issued by one
// of its threads during the next iteration's products.
// (Measured, H200: products of 32 columns, two in flight, 0.97-1.00x; the next stage loaded after the maxima
// exchange, with no barrier at the iteration's start, 0.85-0.88x at 4K and 8K keys: its load then lands late; the
// next iteration's Sᵀ issued before this one's dK and dQ are folded, 0.90-0.97x.)
//
// Compile-time parameters: SB_DP 256 (Q̂ and K̂ rows of 256 bytes in 128-byte column blocks), SB_DQK and SB_DPV
// (the Q·K and V head dims the warpgroups split; specs.BackwardTiles.qk_cols, value_cols), SB_BF16, SB_CAUSAL
// (and the window's SB_WINDOW), SB_VARLEN; fine granularity, no Q-smoothing, soft cap or deterministic order
// (specs.backward_kernel keeps those on backward_wgmma.cu). From specs.BackwardTiles.implied: SB_THREADS (256),
// SB_CTA_KEYS (64), SB_KEY_PAD, SB_DQ_PITCH (DQK: dq_acc rows without padding), and the query-side tensor maps' boxes
// (BackwardTiles.query_maps).
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
static_assert(DQK % 64 == 0 && DQK <= DP && DPV % 64 == 0 && DPV <= DQK, "each warpgroup's columns a whole number of n-tiles");
constexpr int QH = HALF_Q;          // queries of a warpgroup's scores
constexpr int NT = HALF_NT;         // n-tiles of its Sᵀ and dPᵀ
constexpr int DH = DQK / 2;         // dK and dQ columns of a warpgroup
constexpr int DHV = DPV / 2;        // dV columns of a warpgroup
constexpr int NK = DH / 8, NV = DHV / 8;  // their n-tiles (one product each: m64n96, m64n64 at 192/128)
constexpr int NVC = NV > 8 ? NV / 2 : NV;  // dV's n-tiles a product: two products above 64 columns (registers)
constexpr int KS8 = DQK / 32;       // Sᵀ's INT8 k-steps (those past the head dim D are skipped)
constexpr int KS16 = DPV / 16;      // dPᵀ's 16-bit k-steps (those past V's head dim Dv are skipped)
constexpr int DQ_PITCH = SB_DQ_PITCH;
constexpr int DQ_BLOCK = SB_TMA_DQ_COLS;  // a dQ tile's column blocks: 32 f32 columns, 128 bytes a row (swizzled)
static_assert(DQ_PITCH == DQK && DQ_BLOCK == 32 && SB_TMA_DQ_BLOCKS * DQ_BLOCK == DH, "dQ's tiles are tm_dq's boxes of dq_acc's rows");
static_assert(SB_TMA_QROWS == BQ && SB_TMA_Q_COLS == 128 && SB_TMA_QT_ROWS == DQK && SB_TMA_DOT_ROWS == DPV &&
              SB_TMA_DO_COLS == 64, "Q̂ a query block's column blocks; Q̂ᵀ and dÔᵀ every row; dO 64-column boxes");
static_assert(SB_TMA_SWIZZLE_Q == 128 && SB_TMA_SWIZZLE_QT == 64 && SB_TMA_SWIZZLE_DO == 128, "each box in its rows' swizzle");

// Above V's 128 columns two whole stages exceed shared memory: Q̂ᵀ and dÔᵀ, which only the gradient products read,
// then sit in one buffer, loaded at each iteration's start for that iteration (the stages keep Q̂ and dO, which Sᵀ and
// dPᵀ read first).
constexpr bool SPLIT = DPV > 128;
struct PairStage {
    i8 q[BQ * DP];        // Q̂   [64 q][DP] int8, 128-byte column blocks
    u16 dout[BQ * DPV];   // dO  [64 q][DPV] 16-bit, 128-byte column blocks
};
struct GradTiles {
    i8 qt[DQK * BQ];      // Q̂ᵀ  [DQK][64 q] int8, fragment token order
    i8 dot[DPV * BQ];     // dÔᵀ [DPV][64 q] int8, fragment token order
};
struct PairShared {
    i8 k[BKV * DP];                 // K̂  [64 keys][DP], 128-byte column blocks
    i8 kt[DQK * BKV];               // K̂ᵀ [DQK][64 keys]
    u16 v[BKV * DPV];               // V  [64 keys][DPV] 16-bit, 128-byte column blocks
    PairStage stage[2];
    GradTiles grad[SPLIT ? 1 : 2];  // each stage's, or (SPLIT) the iteration's
    i8 pt[BKV * BQ];                // P̂ᵀ [64 keys][64 q] u8, 64-byte rows in fragment token order
    i8 zt[BKV * BQ];                // Ẑᵀ, the same
    i8 ds[BQ * BKV];                // Ŷ  [64 q][64 keys]
    float dq[2][BQ * DH];           // each warpgroup's dQ partial tile: [DH/32 column blocks][64 q][32], swizzled
    float red_key[2][2][BKV];       // [P or Z][warpgroup][key]: a half's per-key maxima
    float red_y[2][4][QH];          // [warpgroup][warp][query of the half]: per-query maxima of |dS|
    float yscale[BQ];               // Ŷ's factor per query (its scale times K̂ᵀ's)
    float4 stats[2][BQ];            // (LSE2, s_Q, δ, s_Qᵀ) per query of each stage
    unsigned long long bar[2];      // each stage's TMA loads (with its GradTiles unless SPLIT)
    unsigned long long grad_bar;    // SPLIT: the GradTiles' loads
};
constexpr int TILE_ALIGN = 1024;
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(PairShared) + (TILE_ALIGN - 128);
// Offsets in a stage, and of the members that need their alignment (members follow one another unpadded).
constexpr int SDO = sizeof(PairStage::q), GDOT = sizeof(GradTiles::qt);
constexpr int STAGE0 = sizeof(PairShared::k) + sizeof(PairShared::kt) + sizeof(PairShared::v);
constexpr int GRAD0 = STAGE0 + sizeof(PairShared::stage);
constexpr int PT_OFF = GRAD0 + sizeof(PairShared::grad), DS_OFF = PT_OFF + 2 * sizeof(PairShared::pt);
constexpr int DQ_OFF = DS_OFF + sizeof(PairShared::ds);
static_assert(sizeof(PairShared::k) % TILE_ALIGN == 0 && (STAGE0 - sizeof(PairShared::v)) % TILE_ALIGN == 0 &&
              STAGE0 % TILE_ALIGN == 0 && sizeof(PairStage) % TILE_ALIGN == 0 && SDO % TILE_ALIGN == 0 &&
              GRAD0 % TILE_ALIGN == 0 && sizeof(GradTiles) % TILE_ALIGN == 0 && GDOT % TILE_ALIGN == 0 &&
              PT_OFF % TILE_ALIGN == 0 && DS_OFF % TILE_ALIGN == 0 && DQ_OFF % TILE_ALIGN == 0 &&
              sizeof(PairStage) == SDO + sizeof(PairStage::dout),
              "wgmma tiles and the dQ tiles' column blocks on their swizzle atoms");
static_assert(DYNAMIC_SHARED_BYTES <= 232448, "one CTA an SM");
constexpr u32 GRAD_LOAD_BYTES = sizeof(GradTiles);
constexpr u32 STAGE_LOAD_BYTES = sizeof(PairStage) + 16 * BQ + (SPLIT ? 0 : GRAD_LOAD_BYTES);
constexpr int BAR_WG = 1;  // named barrier 1 + w: warpgroup w (128 threads)

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attention_backward(SB_KERNEL_PARAMS(SB_BACKWARD_FIELDS), SB_KERNEL_MAPS(SB_BACKWARD_MAPS)) {
    const BackwardParams a = SB_KERNEL_VIEW(BackwardParams, SB_BACKWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((TILE_ALIGN - smem_u32(smem_raw) % TILE_ALIGN) % TILE_ALIGN);
    PairShared& sh = *reinterpret_cast<PairShared*>(smem);
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

    // K̂ and V in one cp.async group, K̂ᵀ in a second, waited for before the first dQ products.
    load_key_block<DP, DQK, DPV, THREADS>(smem_u32(sh.k), smem_u32(sh.v), smem_u32(sh.kt), a, seq, hk, j, tid);
    cp_async_commit();

    auto load_grad = [&](int h, int i, int slot, u32 bar) {  // Q̂ᵀ and dÔᵀ
        const u32 gt = smem_u32(&sh.grad[slot]);
        const int qt_row = static_cast<int>(seq.qt_row0(h, DP));
        tma_load_2d(gt, tm_qt, seq.qt_col0() + i * BQ, qt_row, bar);
        tma_load_2d(gt + GDOT, tm_dot, seq.qt_col0() + i * BQ, qt_row, bar);
    };
    auto load_stage = [&](int h, int i, int slot) {
        const u32 st = smem_u32(&sh.stage[slot]), bar = smem_u32(&sh.bar[slot]);
        mbarrier_arrive_expect_tx(bar, STAGE_LOAD_BYTES);
        tma_load_3d(st, tm_q, 0, static_cast<int>(seq.q_row0(h)) + i * BQ, 0, bar);  // its column blocks in one box
        if (!SPLIT) load_grad(h, i, slot, bar);
        // Packed: dO is one [1][Hq][total][D] tensor; rows past this sequence's end are the next one's, which
        // padded rows' P = 0 (LSE2 = +inf, δ = 0 there) keeps out of every product.
#pragma unroll
        for (int cb = 0; cb < DPV / 64; ++cb)
            tma_load_4d(st + SDO + cb * BQ * 128, tm_do, 64 * cb, seq.q_start() + i * BQ, h, SB_VARLEN ? 0 : seq.b, bar);
        bulk_load(smem_u32(&sh.stats[slot][0]), a.stats + seq.q_row0(h) + i * BQ, 16 * BQ, bar);
    };
    const int h_first = hk * group, i_last = i0 + n_i - 1;
    // (causal: the two-pass kernel's 128-key CTA's sweep, so that dK and dV are bit for bit its results)
    const int i_start = pair_sweep_start(j, i0, i_last, seq);
    int h = h_first, i = i_start, nh = h_first, ni = i_start;
    auto advance = [&](int& hh, int& ii) { sweep_advance(hh, ii, h_first, group, i0, i_last); };
    if (tid == 0) {
        mbarrier_init(smem_u32(&sh.bar[0]), 1);
        mbarrier_init(smem_u32(&sh.bar[1]), 1);
        if (SPLIT) mbarrier_init(smem_u32(&sh.grad_bar), 1);
        fence_mbarrier_init();
        prefetch_tensor_map(tm_q);
        prefetch_tensor_map(tm_qt);
        prefetch_tensor_map(tm_dot);
        prefetch_tensor_map(tm_do);
        prefetch_tensor_map(tm_dq);
        if (n_it > 0) load_stage(nh, ni, 0);
    }
    if (n_it > 0) advance(nh, ni);
    cp_async_wait<1>();
    fence_proxy_async();  // cp.async wrote K̂ and V, which the async proxy reads
    __syncthreads();      // and the mbarriers are initialized

    const int krow = wv * 16 + g;  // this thread's key rows: krow, krow + 8
    // The warpgroup index as a broadcast (a uniform register): descriptors and shared addresses formed from it
    // stay on the uniform datapath.
    const int wgu = warpgroup_uniform();
    float s_k[2];
    {
        const i64 k0 = seq.k_row0(hk) + j * CTA_KEYS + krow;
        s_k[0] = a.k_scale[k0];
        s_k[1] = a.k_scale[k0 + 8];
    }
    const float kt_scale = a.kt_scale[seq.k_block0(hk) + j];  // K̂ᵀ's scale of the key block
    // Keys krow, krow + 8 x the warpgroup's columns 8n + 2t, +1 (dK: DH·w.., dV: DHV·w..).
    float dk[NK][4], dv[NV][4];
#pragma unroll
    for (int n = 0; n < NK; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dk[n][e] = 0.f;
            if (n < NV) dv[n][e] = 0.f;
        }
    // A warpgroup's dQ partial waits in its tile until the next iteration, where the warpgroup's thread REDUCER
    // (not thread 0, which issues the stage loads) adds it into dq_acc once its products are issued.
    const bool reducer = (tid & 127) == 32;
    i64 pending_row = -1;
    auto reduce_dq = [&] {
        tma_reduce_add_3d(tm_dq, 0, static_cast<int>(pending_row), DH / DQ_BLOCK * wgu, smem_u32(sh.dq[wgu]));
        bulk_commit();
    };

    for (int it = 0; it < n_it; ++it, advance(h, i)) {
        __syncthreads();  // the last iteration's stage, codes, Ŷ and maxima are read; its dQ partials are in their tiles
        if (tid == 0 && it + 1 < n_it) load_stage(nh, ni, (it + 1) & 1);
        if (SPLIT && tid == 0) {  // this iteration's Q̂ᵀ and dÔᵀ: the last one's gradient products are done
            mbarrier_arrive_expect_tx(smem_u32(&sh.grad_bar), GRAD_LOAD_BYTES);
            load_grad(h, i, 0, smem_u32(&sh.grad_bar));
        }
        if (it + 1 < n_it) advance(nh, ni);
        const float s_do = a.do_scale[seq.q_block0(h) + i];
        const int slot = it & 1;
        const u32 st = smem_u32(&sh.stage[slot]);
        const float4* stats_s = sh.stats[slot];
        mbarrier_wait(smem_u32(&sh.bar[slot]), (it >> 1) & 1);
        const int q0 = i * BQ;
        const int qh = wgu;
        const int key0 = j * CTA_KEYS, qc0 = q0 + QH * qh;  // the CTA's first key, the warpgroup's first query
        const bool need_mask = qc0 + QH > (SB_VARLEN ? seq.len_q() : a.Lq) ||
                               key0 + BKV > (SB_VARLEN ? seq.len_k() : a.Lk) ||
                               (SB_CAUSAL && key0 + BKV - 1 > qc0 + hi) ||
                               (SB_WINDOW && key0 + a.win_width < qc0 + QH - 1 + hi);

        // Sᵀ, then dPᵀ, of the 64 keys x the warpgroup's 32 queries.
        float p[NT][4], ds[NT][4];
        {
            int s[NT][4];
            wgmma_fence();
            const u32 k_desc = wgmma_desc_lo<DP>(smem_u32(sh.k));
            const u32 q_desc = wgmma_desc_lo<DP>(st) + qh * QH * 128 / 16;
#pragma unroll
            for (int ks = 0; ks < KS8; ++ks)
                if (ks == 0 || 32 * ks < a.D)
                    wgmma_s8_ss(s, wgmma_desc<DP>(k_desc, kstep_offset<DP, BKV>(ks)),
                                wgmma_desc<DP>(q_desc, kstep_offset<DP, BQ>(ks)), ks);
            wgmma_commit();
            const u32 v_desc = wgmma_desc_lo<128>(smem_u32(sh.v));
            const u32 do_desc = wgmma_desc_lo<128>(st + SDO) + qh * QH * 128 / 16;
#pragma unroll
            for (int ks = 0; ks < KS16; ++ks)
                if (ks == 0 || 16 * ks < a.Dv)
                    wgmma_f16_ss<SB_BF16>(ds, wgmma_desc<128>(v_desc, kstep_offset<2 * DPV, BKV>(ks)),
                                          wgmma_desc<128>(do_desc, kstep_offset<2 * DPV, BQ>(ks)), ks);
            wgmma_commit();
            if (reducer && pending_row >= 0) reduce_dq();
            wgmma_wait<1>();
            wgmma_hold_all(s);
            const float no_bias[2] = {0.f, 0.f};
            probabilities(p, s, s_k, no_bias, stats_s, QH * qh, t, key0 + krow, q0, need_mask, seq, hi);
        }

        // Per key (rows krow, krow + 8): the maxima of Pᵀ and |dSᵀ| over the block's 64 queries, this half's and
        // then, in one exchange through shared memory, the other half's.
        float m[4];
        {
            float mp[2];
            row_max<false>(mp, p);
            m[0] = mp[0];
            m[1] = mp[1];
        }
        // dSᵀ = Pᵀ ∘ (dPᵀ - δ), in dPᵀ's registers.
        wgmma_wait<0>();
        wgmma_hold_all(ds);
        ds_from_dp(ds, p, stats_s, QH * qh, t, a);
        {
            float mz[2];
            row_max<true>(mz, ds);
            m[2] = mz[0];
            m[3] = mz[1];
        }
        publish_key_maxima(sh.red_key, m, wgu, krow, t);
        // Every thread is done with the last iteration too: its stage (loaded next), codes, Ŷ and factors, and its
        // dQ partials are in their tiles. (Without a barrier at the top of the loop, the warpgroups overlap the
        // iterations' ends and starts; the maxima's single buffer is safe: the last reads precede the barrier
        // before the gradient products.)
        __syncthreads();
        join_key_maxima(m, sh.red_key, wgu ^ 1, krow);
        // P̂ᵀ (unsigned codes) and Ẑᵀ per key.
        float fac_v[2], fac_k[2];
        {
            const Psi p0 = psi_unsigned(m[0]), p1 = psi_unsigned(m[1]);
            const float inv[2] = {p0.inv, p1.inv};
            fac_v[0] = p0.scale * s_do;
            fac_v[1] = p1.scale * s_do;
            store_half_codes(sh.pt, p, inv, krow, qh, t);
        }
        {
            const Psi z0 = psi(m[2]), z1 = psi(m[3]);
            const float inv[2] = {z0.inv, z1.inv};
            const float s_qt = stats_s[0].w;  // Q̂ᵀ's scale of the query block
            fac_k[0] = z0.scale * s_qt;
            fac_k[1] = z1.scale * s_qt;
            store_half_codes(sh.zt, ds, inv, krow, qh, t);
        }
        // Ŷ per query over the 64 keys, stored [query][key] in 64-byte rows (the warp's keys: chunk wv).
        {
            int yc;
            const Psi ys = half_query_psi(ds, sh.red_y, wgu, wv, g, t, BAR_WG + wgu, yc);
            if (wv == 0) sh.yscale[QH * qh + yc] = ys.scale * kt_scale;
            store_half_y<64>(sh.ds, ds, ys.inv, wv, qh, g, t);
        }
        cp_async_wait<0>();   // K̂ᵀ is in (a no-op after the first iteration)
        fence_proxy_async();  // the codes, Ŷ and K̂ᵀ's copies are read by wgmma
        if (reducer) bulk_wait_read<0>();  // the dQ tile may be rewritten after the barrier
        __syncthreads();      // both halves' P̂ᵀ, Ẑᵀ, Ŷ and Ŷ's factors are in
        if (SPLIT) mbarrier_wait(smem_u32(&sh.grad_bar), it & 1);  // and this iteration's Q̂ᵀ and dÔᵀ

        // The gradient products, one each over the block's 64 queries (dV, dK) or its 64 keys (dQ): dV and dK issued
        // together, dQ once dV is folded, dQ's partial stored to the warpgroup's tile once dK is folded.
        {
            const int ft = static_cast<int>(fresh_tid()), rows = (ft >> 5 & 3) * 16 + (ft >> 2 & 7);
            const u32 pt_lo = wgmma_desc_lo<64>(smem_u32(sh.pt)), zt_lo = wgmma_desc_lo<64>(smem_u32(sh.zt));
            const u32 ds_lo = wgmma_desc_lo<64>(smem_u32(sh.ds));
            const u32 gt = smem_u32(&sh.grad[SPLIT ? 0 : slot]);
            const u32 dot_lo = wgmma_desc_lo<64>(gt + GDOT) + DHV * qh * BQ / 16;
            const u32 qt_lo = wgmma_desc_lo<64>(gt) + DH * qh * BQ / 16;
            const u32 kt_lo = wgmma_desc_lo<64>(smem_u32(sh.kt)) + DH * qh * BKV / 16;
            int pv[NVC][4], pk[NK][4], pq[NK][4];
            auto dv_product = [&](int c) {  // dV's columns c·NVC·8.. of the warpgroup's
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
                    wgmma_u8s8_ss(pv, wgmma_desc<64>(pt_lo, 32 * kk), wgmma_desc<64>(dot_lo + c * NVC * BQ / 2, 32 * kk), kk);
                wgmma_commit();
            };
            auto dv_fold = [&](int c) {
                wgmma_hold_all(pv);
#pragma unroll
                for (int n = 0; n < NVC; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dv[c * NVC + n][e] = fmaf(static_cast<float>(pv[n][e]), fac_v[e >> 1], dv[c * NVC + n][e]);
            };
            auto dq_product = [&] {
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
                    wgmma_s8_ss(pq, wgmma_desc<64>(ds_lo, 32 * kk), wgmma_desc<64>(kt_lo, 32 * kk), kk);
                wgmma_commit();
            };
            auto dk_fold = [&] {
                wgmma_hold_all(pk);
#pragma unroll
                for (int n = 0; n < NK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dk[n][e] = fmaf(static_cast<float>(pk[n][e]), fac_k[e >> 1], dk[n][e]);
            };
            wgmma_fence();
            dv_product(0);
#pragma unroll
            for (int kk = 0; kk < 2; ++kk)
                wgmma_s8_ss(pk, wgmma_desc<64>(zt_lo, 32 * kk), wgmma_desc<64>(qt_lo, 32 * kk), kk);
            wgmma_commit();
            wgmma_wait<1>();
            dv_fold(0);
            if constexpr (NV > NVC) {  // dV's second half while dK is folded, dQ's product while it is
                wgmma_fence();
                dv_product(1);
                wgmma_wait<1>();
                dk_fold();
                dq_product();
                wgmma_wait<1>();
                dv_fold(1);
            } else {
                dq_product();
                wgmma_wait<1>();
                dk_fold();
            }
            wgmma_wait<0>();
            wgmma_hold_all(pq);
            // Rows `rows`, +8 (both ≡ g mod 8), columns 8n + 2t, +1: in column block n/4, 16-byte chunk
            // (2(n%4) + t/2) XOR g (the 128-byte swizzle), word 2(t%2); a warp's stores then fill each chunk twice.
            const int ftt = ft & 3, swz = (ftt >> 1) ^ (rows & 7);
            float* dq_row = sh.dq[qh] + rows * DQ_BLOCK + 2 * (ftt & 1);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float f = sh.yscale[rows + 8 * half];
#pragma unroll
                for (int n = 0; n < NK; ++n)
                    *reinterpret_cast<float2*>(dq_row + half * 8 * DQ_BLOCK + n / 4 * BQ * DQ_BLOCK +
                                               4 * ((2 * (n % 4)) ^ swz)) =
                        make_float2(static_cast<float>(pq[n][2 * half]) * f, static_cast<float>(pq[n][2 * half + 1]) * f);
            }
        }
        fence_proxy_async();  // the TMA reduction reads these stores
        pending_row = seq.q_row0(h) + q0;
    }

    cp_async_wait<0>();
    if (pending_row >= 0) {
        __syncthreads();  // the last partials are in their tiles
        if (reducer) {
            reduce_dq();
            bulk_wait_read<0>();
        }
    }
    // dK (factor ln 2: Q̂ holds c·log2(e)·Q) and dV (V's head dim Dv of columns) of this thread's keys x the
    // warpgroup's columns.
    const int ft = static_cast<int>(fresh_tid()), fw = ft >> 7, ft_t = ft & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = j * CTA_KEYS + (ft >> 5 & 3) * 16 + (ft >> 2 & 7) + 8 * half;
        if (key >= seq.len_k()) continue;
        u16* kr = a.dk + seq.key_token(a.kb, a.kh, a.kn, hk, key);
        u16* vr = a.dv + seq.key_token(a.wb, a.wh, a.wn, hk, key);
#pragma unroll
        for (int n = 0; n < NK; ++n) {
            const int col = fw * DH + n * 8 + 2 * ft_t;
            if (col < a.D)
                *reinterpret_cast<u32*>(kr + col) = pack2_f32<SB_BF16>(dk[n][2 * half] * 0.6931471805599453f,
                                                                       dk[n][2 * half + 1] * 0.6931471805599453f);
            const int vcol = fw * DHV + n * 8 + 2 * ft_t;
            if (n < NV && vcol < a.Dv) *reinterpret_cast<u32*>(vr + vcol) = pack2_f32<SB_BF16>(dv[n][2 * half], dv[n][2 * half + 1]);
        }
    }
}
