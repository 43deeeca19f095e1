// SageBwd backward on Hopper (sm_90a) at head dim 128 with four computing warpgroups a 128-key CTA: the
// numerics and products of backward_wgmma.cu (quantization blocks of 64 keys x 64 queries, the same scales,
// codes and folds, so dK and dV are bit for bit that kernel's), split by queries so that a CTA runs 16 warps
// (4 a scheduler) where that kernel runs 8: its dK and dV accumulators (128 registers a thread) are halved
// by the split of the head dim below, which leaves 128 registers a thread for 512 threads.
//   warpgroup w = (key block kb = w / 2, query half qh = w % 2): Sᵀ and dPᵀ of the 64 keys of kb x the
//   32 queries of qh (m64n32), Pᵀ, dSᵀ, and their codes: P̂ᵀ and Ẑᵀ per key over the block's 64 queries
//   (the pair of warpgroups of kb exchange their halves' maxima through shared memory), stored in
//   shared memory as [64 keys][64 queries] A tiles; Ŷ per query over the 64 keys (inside the warpgroup).
//   dV and dK of the 64 keys of kb x head-dim columns 64·qh.. (two 32-column chunks each), A (P̂ᵀ, Ẑᵀ) from
//   shared memory over both halves' queries; dQ's columns 32w.. over both key blocks (Ŷ K̂ᵀ).
// Barriers an iteration: two CTA-wide (the iteration's start; Ŷ of both key blocks before dQ), two of a
// pair (the maxima exchange, and the codes of both halves before dV and dK), one of a warpgroup (Ŷ's
// maxima). The dQ partial goes through a shared [64][DP+8] f32 tile to one bulk reduction, as there.
// Measured slower than backward_wgmma.cu (docs/PERFORMANCE.md): opt-in, SAGEBWD_BACKWARD_QUAD=1.
//
// Compile-time parameters: SB_DP 128, SB_BF16, SB_CAUSAL (and the window's SB_WINDOW), SB_FINE 1 (dense batches:
// packed ones spilled under NVRTC 13.0);
// no Q-smoothing, soft cap or deterministic order (specs.backward_kernel keeps those on backward_wgmma.cu).
// From specs.BackwardTiles.implied: SB_THREADS (512), SB_CTA_KEYS (128), SB_KEY_PAD, SB_DQ_PITCH, SB_GRID_ORDER
// and the query-side tensor maps' boxes (the same as backward_wgmma.cu's at head dim 128).
#include "backward_halves.cuh"
#include "wgmma.cuh"
#include "bulk.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "tma.cuh"

constexpr int DP = SB_DP;
constexpr int BQ = SB_BLOCK_Q, BKV = SB_BLOCK_KV;
constexpr int CTA_KEYS = SB_CTA_KEYS, THREADS = SB_THREADS;
static_assert(DP == 128 && BQ == 64 && BKV == 64 && CTA_KEYS == 128 && THREADS == 512, "four warpgroups at head dim 128");
static_assert(SB_FINE && !SB_BIAS && !SB_SOFTCAP && !SB_DETERMINISTIC && !SB_VARLEN,
              "fine granularity, no Q-smoothing, no soft cap, not deterministic, dense batches");
constexpr int QH = HALF_Q;          // queries of a warpgroup
constexpr int NT = HALF_NT;         // n-tiles of its Sᵀ and dPᵀ
constexpr int DH = DP / 2;          // dK and dV columns of a warpgroup
constexpr int CH = DH / 32;         // their 32-column chunks
constexpr int DQ_COLS = DP / 4;     // dQ columns of a warpgroup
constexpr int DQ_PITCH = SB_DQ_PITCH;
static_assert(DQ_PITCH == DP + 8 && SB_TMA_DQ_COLS == DQ_PITCH, "dQ's tile is dq_acc's rows");
static_assert(SB_TMA_QROWS == BQ && SB_TMA_Q_COLS == DP && SB_TMA_QT_ROWS == DP && SB_TMA_DO_COLS == 64,
              "the query-side boxes of backward_wgmma.cu at head dim 128");
static_assert(SB_TMA_SWIZZLE_Q == 128 && SB_TMA_SWIZZLE_QT == 64 && SB_TMA_SWIZZLE_DO == 128, "each box in its rows' swizzle");

struct QuadStage {
    i8 q[BQ * DP];       // Q̂   [64 q][128] int8
    i8 qt[DP * BQ];      // Q̂ᵀ  [128][64 q] int8, fragment token order
    i8 dot[DP * BQ];     // dÔᵀ [128][64 q] int8, fragment token order
    u16 dout[BQ * DP];   // dO  [64 q][128] 16-bit, two 128-byte column blocks
};
struct QuadShared {
    i8 k[CTA_KEYS * DP];            // K̂  [128 keys][128]
    i8 kt[DP * CTA_KEYS];           // K̂ᵀ [128][128 keys]
    u16 v[CTA_KEYS * DP];           // V  [128 keys][128] 16-bit, two column blocks
    QuadStage stage[2];
    i8 pt[2][BKV * BQ];             // P̂ᵀ [key block][64 keys][64 q] u8, 64-byte rows in fragment token order
    i8 zt[2][BKV * BQ];             // Ẑᵀ, the same
    i8 ds[BQ * CTA_KEYS];           // Ŷ  [64 q][128 keys]
    float dq[BQ * DQ_PITCH];        // dQ's partial tile
    float red_key[2][4][BKV];       // [P or Z][warpgroup][key]: a half's per-key maxima
    float red_y[4][4][QH];          // [warpgroup][warp][query of the half]: per-query maxima of |dS|
    float yscale[2][BQ];            // Ŷ's factor per (key block, query)
    float kt_scale[4];              // K̂ᵀ's scale of each key block (two used)
    float4 stats[2][BQ];            // (LSE2, s_Q, δ, s_Qᵀ) per query of each stage
    unsigned long long bar[2];      // each stage's TMA loads
};
constexpr int TILE_ALIGN = 1024;
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(QuadShared) + (TILE_ALIGN - 128);
// Offsets in a stage, and of the members that need their alignment (members follow one another unpadded).
constexpr int SQT = sizeof(QuadStage::q), SDOT = SQT + sizeof(QuadStage::qt), SDO = SDOT + sizeof(QuadStage::dot);
constexpr int STAGE0 = sizeof(QuadShared::k) + sizeof(QuadShared::kt) + sizeof(QuadShared::v);
constexpr int PT_OFF = STAGE0 + sizeof(QuadShared::stage), DS_OFF = PT_OFF + 2 * sizeof(QuadShared::pt);
constexpr int DQ_OFF = DS_OFF + sizeof(QuadShared::ds);
static_assert(STAGE0 % TILE_ALIGN == 0 && sizeof(QuadStage) % TILE_ALIGN == 0 && PT_OFF % TILE_ALIGN == 0 &&
              DS_OFF % TILE_ALIGN == 0 && DQ_OFF % 128 == 0 && sizeof(QuadStage) == SDO + sizeof(QuadStage::dout),
              "wgmma tiles on their swizzle atoms, dQ's tile on 128 bytes");
constexpr u32 STAGE_LOAD_BYTES = sizeof(QuadStage) + 16 * BQ;
// Named barriers: 1 + kb the pair of key block kb (256 threads), 3 + w warpgroup w (128).
constexpr int BAR_PAIR = 1, BAR_WG = 3;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attention_backward(SB_KERNEL_PARAMS(SB_BACKWARD_FIELDS), SB_KERNEL_MAPS(SB_BACKWARD_MAPS)) {
    const BackwardParams a = SB_KERNEL_VIEW(BackwardParams, SB_BACKWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((TILE_ALIGN - smem_u32(smem_raw) % TILE_ALIGN) % TILE_ALIGN);
    QuadShared& sh = *reinterpret_cast<QuadShared*>(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wv = warp & 3;
    const GridCell cell = backward_cell(a.grid_order);
    const int j = cell.j, hk = cell.hk, b = cell.b;
    const int group = a.Hq / a.Hkv;
    const BackwardSeq seq(a, b);
    const int hi = seq.band_hi();
    static_assert(CTA_KEYS == BACKWARD_CTA_KEYS, "backward_common.cuh's key count");
    const QueryBlocks qb = query_blocks(j * CTA_KEYS, CTA_KEYS, seq);
    const int i0 = qb.i0, n_i = qb.n_i, n_it = group * n_i;
    const u32 base = smem_u32(smem);

    // K̂ and V in one cp.async group, K̂ᵀ in a second, waited for before the first dQ products.
    {
        const int kvalid = min(CTA_KEYS, seq.len_k() - j * CTA_KEYS);
        load_tile<DP, CTA_KEYS, THREADS, true>(smem_u32(sh.k), a.k8 + (seq.k_row0(hk) + j * CTA_KEYS) * DP, DP);
        const u16* vsrc = a.v + seq.key_token(a.vb, a.vh, a.vn, hk, static_cast<i64>(j) * CTA_KEYS);
        constexpr int VCH = 2 * DP / 16, VROWS = THREADS / VCH;  // 16-byte chunks of a row; rows a pass
        const int r0 = tid / VCH, c = tid % VCH;
#pragma unroll
        for (int k = 0; k < CTA_KEYS / VROWS; ++k) {
            const int r = r0 + k * VROWS;
            const bool ok = c * 8 < a.Dv && r < kvalid;  // zero past the keys and V's head dim
            cp_async_16(smem_u32(sh.v) + wgmma_tile_offset<2 * DP, CTA_KEYS>(r, c), ok ? vsrc + r * a.vn + 8 * c : vsrc,
                        ok ? 16 : 0);
        }
        cp_async_commit();
        load_tile<128, DP, THREADS, true>(smem_u32(sh.kt), a.k8t + seq.kt_base(hk, DP) + j * CTA_KEYS, seq.nk_pad());
        cp_async_commit();
    }

    auto load_stage = [&](int h, int i, int slot) {
        const u32 st = smem_u32(&sh.stage[slot]), bar = smem_u32(&sh.bar[slot]);
        mbarrier_arrive_expect_tx(bar, STAGE_LOAD_BYTES);
        tma_load_3d(st, tm_q, 0, static_cast<int>(seq.q_row0(h)) + i * BQ, 0, bar);
        const int qt_row = static_cast<int>(seq.qt_row0(h, DP));
        tma_load_2d(st + SQT, tm_qt, seq.qt_col0() + i * BQ, qt_row, bar);
        tma_load_2d(st + SDOT, tm_dot, seq.qt_col0() + i * BQ, qt_row, bar);
#pragma unroll
        for (int cb = 0; cb < 2; ++cb)
            tma_load_4d(st + SDO + cb * BQ * 128, tm_do, 64 * cb, seq.q_start() + i * BQ, h,
                        seq.b, bar);
        bulk_load(smem_u32(&sh.stats[slot][0]), a.stats + seq.q_row0(h) + i * BQ, 16 * BQ, bar);
    };
    const int h_first = hk * group, i_last = i0 + n_i - 1;
    const int i_start = SB_CAUSAL ? i_last - j % SWEEP_ROTATE % max(n_i, 1) : i0;
    int h = h_first, i = i_start, nh = h_first, ni = i_start;
    auto advance = [&](int& hh, int& ii) { sweep_advance(hh, ii, h_first, group, i0, i_last); };
    if (tid == 0) {
        mbarrier_init(smem_u32(&sh.bar[0]), 1);
        mbarrier_init(smem_u32(&sh.bar[1]), 1);
        fence_mbarrier_init();
        prefetch_tensor_map(tm_q);
        prefetch_tensor_map(tm_qt);
        prefetch_tensor_map(tm_dot);
        prefetch_tensor_map(tm_do);
        if (n_it > 0) load_stage(nh, ni, 0);
    }
    if (tid < 2) sh.kt_scale[tid] = a.kt_scale[seq.k_block0(hk) + j * 2 + tid];
    if (n_it > 0) advance(nh, ni);
    cp_async_wait<1>();
    fence_proxy_async();  // cp.async wrote K̂ and V, which wgmma reads
    __syncthreads();      // and the mbarriers are initialized

    const int krow = wv * 16 + g;  // this thread's key rows in its key block: krow, krow + 8
    // The warpgroup index as a broadcast, which ptxas holds in a uniform register: the descriptors and shared
    // addresses formed from it stay on the uniform datapath (formed from the thread index, every wgmma took four
    // R2UR and two moves a thread).
    const int wgu = warpgroup_uniform();
    float s_k[2];
    {
        const i64 k0 = seq.k_row0(hk) + j * CTA_KEYS + (wgu >> 1) * BKV + krow;
        s_k[0] = a.k_scale[k0];
        s_k[1] = a.k_scale[k0 + 8];
    }
    // Keys krow, krow + 8 x columns 64·qh + 32c + 8n + 2t, +1.
    float dk[CH][4][4], dv[CH][4][4];
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[c][n][e] = dv[c][n][e] = 0.f;
    // The dQ partial waits in its tile until the next iteration, where thread REDUCER (not thread 0, which issues
    // the stage loads) adds it into dq_acc once its warpgroup's products are issued.
    constexpr int REDUCER = 128;
    i64 pending_row = -1;
    auto reduce_dq = [&] {
        bulk_reduce_add_f32(a.dq_acc + pending_row * DQ_PITCH, smem_u32(sh.dq), BQ * DQ_PITCH * 4);
        bulk_commit();
    };

    float s_do_next = n_it > 0 ? a.do_scale[seq.q_block0(h) + i] : 0.f;
    for (int it = 0; it < n_it; ++it, advance(h, i)) {
        __syncthreads();  // the last iteration's stage, codes, Ŷ and maxima are read; its dQ partial is in its tile
        if (tid == 0 && it + 1 < n_it) load_stage(nh, ni, (it + 1) & 1);
        const float s_do = s_do_next;  // dÔ's scale of this query block, read an iteration ahead
        if (it + 1 < n_it) s_do_next = a.do_scale[seq.q_block0(nh) + ni];
        if (it + 1 < n_it) advance(nh, ni);
        const int slot = it & 1;
        const u32 st = smem_u32(&sh.stage[slot]);
        const float4* stats_s = sh.stats[slot];
        mbarrier_wait(smem_u32(&sh.bar[slot]), (it >> 1) & 1);
        const int q0 = i * BQ;
        const int kb = wgu >> 1, qh = wgu & 1;
        const int key0 = j * CTA_KEYS + kb * BKV, qc0 = q0 + QH * qh;  // the warpgroup's first key and query
        const bool need_mask = qc0 + QH > a.Lq || key0 + BKV > a.Lk ||
                               (SB_CAUSAL && key0 + BKV - 1 > qc0 + hi) ||
                               (SB_WINDOW && key0 + a.win_width < qc0 + QH - 1 + hi);

        // Sᵀ, then dPᵀ, of the warpgroup's 64 keys x 32 queries.
        float p[NT][4], ds[NT][4];
        {
            int s[NT][4];
            wgmma_fence();
            const u32 k_desc = wgmma_desc_lo<DP>(smem_u32(sh.k)) + kb * BKV * DP / 16;
            const u32 q_desc = wgmma_desc_lo<DP>(st) + qh * QH * DP / 16;
#pragma unroll
            for (int ks = 0; ks < DP / 32; ++ks)
                wgmma_s8_ss(s, wgmma_desc<DP>(k_desc, 32 * ks), wgmma_desc<DP>(q_desc, 32 * ks), ks);
            wgmma_commit();
            const u32 v_desc = wgmma_desc_lo<128>(smem_u32(sh.v)) + kb * BKV * 128 / 16;
            const u32 do_desc = wgmma_desc_lo<128>(st + SDO) + qh * QH * 128 / 16;
#pragma unroll
            for (int ks = 0; ks < DP / 16; ++ks)
                wgmma_f16_ss<SB_BF16>(ds, wgmma_desc<128>(v_desc, kstep_offset<2 * DP, CTA_KEYS>(ks)),
                                      wgmma_desc<128>(do_desc, kstep_offset<2 * DP, BQ>(ks)), ks);
            wgmma_commit();
            if (tid == REDUCER && pending_row >= 0) reduce_dq();
            wgmma_wait<1>();
            wgmma_hold_all(s);
            const float no_bias[2] = {0.f, 0.f};
            probabilities(p, s, s_k, no_bias, stats_s, QH * qh, t, key0 + krow, q0, need_mask, seq, hi);
        }

        // Per key (rows krow, krow + 8): the maxima of Pᵀ and |dSᵀ| over the block's 64 queries, this half's and
        // then, in one exchange through shared memory, the pair's other half's.
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
        named_barrier<256>(BAR_PAIR + kb);
        join_key_maxima(m, sh.red_key, wgu ^ 1, krow);
        // P̂ᵀ (unsigned codes) and Ẑᵀ per key.
        float fac_v[2], fac_k[2];
        {
            const Psi p0 = psi_unsigned(m[0]), p1 = psi_unsigned(m[1]);
            const float inv[2] = {p0.inv, p1.inv};
            fac_v[0] = p0.scale * s_do;
            fac_v[1] = p1.scale * s_do;
            store_half_codes(sh.pt[kb], p, inv, krow, qh, t);
        }
        {
            const Psi z0 = psi(m[2]), z1 = psi(m[3]);
            const float inv[2] = {z0.inv, z1.inv};
            fac_k[0] = z0.scale;
            fac_k[1] = z1.scale;
            store_half_codes(sh.zt[kb], ds, inv, krow, qh, t);
        }
        // Ŷ per query over the key block's 64 keys, stored [query][key of the CTA] (the warp's keys: chunk 4·kb + wv).
        {
            int yc;
            const Psi ys = half_query_psi(ds, sh.red_y, wgu, wv, g, t, BAR_WG + wgu, yc);
            if (wv == 0) sh.yscale[kb][QH * qh + yc] = ys.scale * sh.kt_scale[kb];
            store_half_y<128>(sh.ds, ds, ys.inv, 4 * kb + wv, qh, g, t);
        }
        fence_proxy_async();  // the codes and Ŷ are read by wgmma
        named_barrier<256>(BAR_PAIR + kb);  // both halves' P̂ᵀ and Ẑᵀ are in

        // dV += P̂ᵀ dÔ and dK += Ẑᵀ Q̂ᵀ over the block's 64 queries, for the warpgroup's 64 columns, a 32-column
        // chunk at a time (each folded while the next runs).
        {
            const u32 pt_lo = wgmma_desc_lo<64>(smem_u32(sh.pt[kb])), zt_lo = wgmma_desc_lo<64>(smem_u32(sh.zt[kb]));
            const u32 dot_lo = wgmma_desc_lo<64>(st + SDOT) + qh * DH * BQ / 16;
            const u32 qt_lo = wgmma_desc_lo<64>(st + SQT) + qh * DH * BQ / 16;
            int pr[2][4][4];
            auto issue = [&](int x) {  // product x: dV chunk x (x < CH), else dK chunk x - CH
                const bool is_v = x < CH;
                const int c = is_v ? x : x - CH;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    const u64 bd = wgmma_desc<64>(is_v ? dot_lo : qt_lo, c * 32 * BQ + 32 * kk);
                    if (is_v) wgmma_u8s8_ss(pr[x & 1], wgmma_desc<64>(pt_lo, 32 * kk), bd, kk);
                    else wgmma_s8_ss(pr[x & 1], wgmma_desc<64>(zt_lo, 32 * kk), bd, kk);
                }
                wgmma_commit();
            };
            const float s_qt = stats_s[0].w;
            const float fk[2] = {fac_k[0] * s_qt, fac_k[1] * s_qt};
            issue(0);
#pragma unroll
            for (int x = 0; x < 2 * CH; ++x) {
                if (x + 1 < 2 * CH) issue(x + 1);
                if (x + 1 < 2 * CH) wgmma_wait<1>(); else wgmma_wait<0>();
                wgmma_hold_all(pr[x & 1]);
                float (&acc)[4][4] = x < CH ? dv[x] : dk[x - CH];
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[n][e] = fmaf(static_cast<float>(pr[x & 1][n][e]), x < CH ? fac_v[e >> 1] : fk[e >> 1], acc[n][e]);
            }
        }

        cp_async_wait<0>();   // K̂ᵀ is in (a no-op after the first iteration)
        fence_proxy_async();
        if (tid == REDUCER) bulk_wait_read<0>();  // the dQ tile may be rewritten after the barrier
        __syncthreads();      // Ŷ and its factors of both key blocks are in

        // dQ's columns 32w.. of the 64 queries: Σ over the key blocks of ŷ[kb][query]·(Ŷ_kb K̂ᵀ_kb).
        {
            const int ft = static_cast<int>(fresh_tid()), rows = (ft >> 5 & 3) * 16 + (ft >> 2 & 7);
            const u32 ds_lo = wgmma_desc_lo<128>(smem_u32(sh.ds));
            const u32 kt_lo = wgmma_desc_lo<128>(smem_u32(sh.kt)) + DQ_COLS * wgu * 128 / 16;
            int pq[2][4][4];
            wgmma_fence();
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2)
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
                    wgmma_s8_ss(pq[k2], wgmma_desc<128>(ds_lo, 64 * k2 + 32 * kk), wgmma_desc<128>(kt_lo, 64 * k2 + 32 * kk), kk);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_hold_all(pq[0]);
            wgmma_hold_all(pq[1]);
            float* dq_row = sh.dq + rows * DQ_PITCH + DQ_COLS * wgu + 2 * (ft & 3);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float f0 = sh.yscale[0][rows + 8 * half], f1 = sh.yscale[1][rows + 8 * half];
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    float2 x = make_float2(static_cast<float>(pq[0][n][2 * half]) * f0, static_cast<float>(pq[0][n][2 * half + 1]) * f0);
                    x.x = fmaf(static_cast<float>(pq[1][n][2 * half]), f1, x.x);
                    x.y = fmaf(static_cast<float>(pq[1][n][2 * half + 1]), f1, x.y);
                    *reinterpret_cast<float2*>(dq_row + half * 8 * DQ_PITCH + 8 * n) = x;
                }
            }
        }
        fence_proxy_async();  // the bulk reduction reads these stores
        pending_row = seq.q_row0(h) + q0;
    }

    cp_async_wait<0>();
    if (pending_row >= 0) {
        __syncthreads();  // the last partial is in its tile
        if (tid == REDUCER) {
            reduce_dq();
            bulk_wait_read<0>();
        }
    }
    // dK (factor ln 2: Q̂ holds c·log2(e)·Q) and dV of this thread's keys x the warpgroup's 64 columns.
    const int ft = static_cast<int>(fresh_tid()), fw = ft >> 7;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = j * CTA_KEYS + (fw >> 1) * BKV + (ft >> 5 & 3) * 16 + (ft >> 2 & 7) + 8 * half;
        if (key >= seq.len_k()) continue;
        u16* kr = a.dk + seq.key_token(a.kb, a.kh, a.kn, hk, key);
        u16* vr = a.dv + seq.key_token(a.wb, a.wh, a.wn, hk, key);
#pragma unroll
        for (int c = 0; c < CH; ++c)
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int col = (fw & 1) * DH + c * 32 + n * 8 + 2 * (ft & 3);
                if (col >= a.D) continue;
                *reinterpret_cast<u32*>(kr + col) =
                    pack2_f32<SB_BF16>(dk[c][n][2 * half] * 0.6931471805599453f, dk[c][n][2 * half + 1] * 0.6931471805599453f);
                if (col < a.Dv) *reinterpret_cast<u32*>(vr + col) = pack2_f32<SB_BF16>(dv[c][n][2 * half], dv[c][n][2 * half + 1]);
            }
    }
}
