// Experiment, not a library kernel (tools/experiments/registers.py compiles it; nothing launches it): the
// register footprint of a four-warpgroup sm_90 backward at head dim 128, where 16 warps an SM allow 128
// registers a thread. The data flow of backward_wgmma.cu's iteration, split by queries: warpgroup w = (key block
// kb = w / 2, query half qh = w % 2) forms Sᵀ, dPᵀ, P and dS for its 64 keys x 32 queries; P̂ᵀ and Ẑᵀ go through
// shared memory (per-key maxima exchanged between the pair), and the warpgroup accumulates dV and dK for its 64 keys
// x head-dim half qh from both halves' codes; Ŷ per query over the key block; dQ's 32 columns 32w.. over both key
// blocks. Shapes, swizzles and masks follow the real kernel closely enough for a register count, not for results.
#include "backward_common.cuh"
#include "wgmma.cuh"
#include "bulk.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "tma.cuh"

// Switches (-D): EXP_PAIR 0 takes each key's maxima from this half's queries alone (wrong scales: how much the
// pair's exchange costs in registers); EXP_PIPE 1 keeps both 32-column chunks of dV's and dK's products in flight.
#ifndef EXP_PAIR
#define EXP_PAIR 1
#endif
#ifndef EXP_PIPE
#define EXP_PIPE 0
#endif
#ifndef EXP_DP_LATE  // 1: dPᵀ issued once P̂ᵀ's codes are stored (its accumulator not in flight beside the softmax)
#define EXP_DP_LATE 0
#endif
constexpr int DP = 128, BQ = 64, BKV = 64, CTA_KEYS = 128, THREADS = 512;
constexpr int NT = 4;        // n-tiles of a warp's 32 query columns
constexpr int DH = DP / 2;   // dK and dV columns of a warpgroup
constexpr int CH = 2;        // 32-column chunks of them
constexpr int DQ_PITCH = DP + 8;

struct Stage {
    i8 q[BQ * DP];
    i8 qt[DP * BQ];
    i8 dot[DP * BQ];
    u16 dout[BQ * DP];
};
struct Shared {
    i8 k[CTA_KEYS * DP];
    i8 kt[DP * CTA_KEYS];
    u16 v[CTA_KEYS * DP];
    Stage st[2];
    i8 pt[2][BKV * BQ];   // P̂ᵀ [key block][64 keys][64 q], 64-byte rows
    i8 zt[2][BKV * BQ];   // Ẑᵀ
    i8 ds[BQ * CTA_KEYS];  // Ŷ [64 q][128 keys]
    float dq[BQ * DQ_PITCH];
    float red_key[2][4][2][BKV];  // [P or Z][warpgroup][half of the pair][key]: per-key maxima
    float red_y[4][4][32];        // [warpgroup][warp][query of the half]
    float yscale[2][BQ];
    float4 stats[2][BQ];
    unsigned long long bar[2];
};
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(Shared) + 1024;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attention_backward(SB_KERNEL_PARAMS(SB_BACKWARD_FIELDS), SB_KERNEL_MAPS(SB_BACKWARD_MAPS)) {
    const BackwardParams a = SB_KERNEL_VIEW(BackwardParams, SB_BACKWARD_FIELDS);
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - smem_u32(smem_raw) % 1024) % 1024);
    Shared& sh = *reinterpret_cast<Shared*>(smem);
    const u32 base = smem_u32(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, wv = warp & 3, kb = wg >> 1, qh = wg & 1;
    const GridCell cell = backward_cell(a.grid_order);
    const int j = cell.j, hk = cell.hk, b = cell.b;
    const BackwardSeq seq(a, b);
    const int hi = seq.band_hi();
    const QueryBlocks qb = query_blocks(j * CTA_KEYS, CTA_KEYS, seq);
    const int group = a.Hq / a.Hkv, n_it = group * qb.n_i;

    load_tile<DP, CTA_KEYS, THREADS, true>(smem_u32(sh.k), a.k8 + (seq.k_row0(hk) + j * CTA_KEYS) * DP, DP);
    load_tile<128, DP, THREADS, true>(smem_u32(sh.kt), a.k8t + seq.kt_base(hk, DP) + j * CTA_KEYS, seq.nk_pad());
    {
        const u16* vsrc = a.v + seq.key_token(a.vb, a.vh, a.vn, hk, static_cast<i64>(j) * CTA_KEYS);
#pragma unroll
        for (int k = 0; k < CTA_KEYS * DP / 8 / THREADS; ++k) {
            const int idx = tid + k * THREADS, r = idx / (DP / 8), c = idx % (DP / 8);
            cp_async_16(smem_u32(sh.v) + wgmma_tile_offset<2 * DP, CTA_KEYS>(r, c), vsrc + r * a.vn + 8 * c, 16);
        }
    }
    cp_async_commit();
    const int h_first = hk * group, i_last = qb.i0 + qb.n_i - 1;
    int h = h_first, i = qb.i0, nh = h_first, ni = qb.i0;
    auto advance = [&](int& hh, int& ii) { sweep_advance(hh, ii, h_first, group, qb.i0, i_last); };
    auto load_stage = [&](int hh, int ii, int slot) {
        const u32 st = smem_u32(&sh.st[0]) + slot * static_cast<u32>(sizeof(Stage)), bar = smem_u32(&sh.bar[0]) + 8 * slot;
        mbarrier_arrive_expect_tx(bar, sizeof(Stage) + 16 * BQ);
        tma_load_3d(st, tm_q, 0, static_cast<int>(seq.q_row0(hh)) + ii * BQ, 0, bar);
        const int qt_row = static_cast<int>(seq.qt_row0(hh, DP));
        tma_load_2d(st + BQ * DP, tm_qt, seq.qt_col0() + ii * BQ, qt_row, bar);
        tma_load_2d(st + BQ * DP + DP * BQ, tm_dot, seq.qt_col0() + ii * BQ, qt_row, bar);
#pragma unroll
        for (int cb = 0; cb < 2; ++cb)
            tma_load_4d(st + BQ * DP + 2 * DP * BQ + cb * BQ * 128, tm_do, 64 * cb, seq.q_start() + ii * BQ, hh, seq.b, bar);
        bulk_load(smem_u32(&sh.stats[0][0]) + slot * 16 * BQ, a.stats + seq.q_row0(hh) + ii * BQ, 16 * BQ, bar);
    };
    if (tid == 0) {
        mbarrier_init(smem_u32(&sh.bar[0]), 1);
        mbarrier_init(smem_u32(&sh.bar[1]), 1);
        fence_mbarrier_init();
        if (n_it > 0) load_stage(nh, ni, 0);
    }
    if (n_it > 0) advance(nh, ni);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();

    const int krow = wv * 16 + g;
    float s_k[2];
    s_k[0] = a.k_scale[seq.k_row0(hk) + j * CTA_KEYS + kb * BKV + krow];
    s_k[1] = a.k_scale[seq.k_row0(hk) + j * CTA_KEYS + kb * BKV + krow + 8];
    float dk[CH][4][4], dv[CH][4][4];
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[c][n][e] = dv[c][n][e] = 0.f;
    i64 pending_row = -1;

    for (int it = 0; it < n_it; ++it, advance(h, i)) {
        __syncthreads();  // the last iteration's Ŷ, codes and dQ tile are read; the next stage's slot is free
        if (tid == 0) {
            if (pending_row >= 0) {
                bulk_reduce_add_f32(a.dq_acc + pending_row * DQ_PITCH, smem_u32(sh.dq), BQ * DQ_PITCH * 4);
                bulk_commit();
            }
            if (it + 1 < n_it) load_stage(nh, ni, (it + 1) & 1);
        }
        if (it + 1 < n_it) advance(nh, ni);
        const int slot = it & 1;
        const u32 st = smem_u32(&sh.st[0]) + slot * static_cast<u32>(sizeof(Stage));
        const float4* stats_s = sh.stats[slot] + 32 * qh;  // this warpgroup's 32 query columns
        const float s_do = a.do_scale[seq.q_block0(h) + i];
        mbarrier_wait(smem_u32(&sh.bar[0]) + 8 * slot, (it >> 1) & 1);
        const int q0 = i * BQ;
        const int key0 = j * CTA_KEYS + kb * BKV;
        const bool need_mask = q0 + BQ > a.Lq || key0 + BKV > a.Lk || (SB_CAUSAL && key0 + BKV - 1 > q0 + hi);

        // Sᵀ and dPᵀ: the warpgroup's 64 keys x its 32 queries.
        int s[NT][4];
        float ds[NT][4];
        wgmma_fence();
        const u32 k_desc = wgmma_desc_lo<DP>(smem_u32(sh.k)) + kb * BKV * DP / 16;
        const u32 q_desc = wgmma_desc_lo<DP>(st) + qh * 32 * DP / 16;
#pragma unroll
        for (int ks = 0; ks < DP / 32; ++ks)
            wgmma_s8_ss(s, wgmma_desc<DP>(k_desc, kstep_offset<DP, CTA_KEYS>(ks)), wgmma_desc<DP>(q_desc, kstep_offset<DP, BQ>(ks)), ks);
        wgmma_commit();
        // dPᵀ: issued beside Sᵀ, or (EXP_DP_LATE) once P̂ᵀ's codes are stored.
        auto issue_dp = [&] {
            const u32 v_desc = wgmma_desc_lo<128>(smem_u32(sh.v)) + kb * BKV * 128 / 16;
            const u32 do_desc = wgmma_desc_lo<128>(st + BQ * DP + 2 * DP * BQ) + qh * 32 * 128 / 16;
            if (EXP_DP_LATE) wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < DP / 16; ++ks)
                wgmma_f16_ss<SB_BF16>(ds, wgmma_desc<128>(v_desc, kstep_offset<2 * DP, CTA_KEYS>(ks)),
                                      wgmma_desc<128>(do_desc, kstep_offset<2 * DP, BQ>(ks)), ks);
            wgmma_commit();
        };
        if (!EXP_DP_LATE) issue_dp();
        if (EXP_DP_LATE) wgmma_wait<0>(); else wgmma_wait<1>();
        wgmma_hold_all(s);
        float p[NT][4];
        const float bias_row[2] = {0.f, 0.f};
        probabilities(p, s, s_k, bias_row, stats_s, 0, t, key0 + krow, q0 + 32 * qh, need_mask, seq, hi);

        // Per-key maxima over the pair's 64 queries: this half's, then the other's through shared memory.
        auto pair_max = [&](int which, const float (&m)[2]) {
            if (t == 0) {
                sh.red_key[which][wg][0][krow] = m[0];
                sh.red_key[which][wg][0][krow + 8] = m[1];
            }
            named_barrier<256>(1 + kb);
            float out[2];
            out[0] = max_nan(m[0], sh.red_key[which][wg ^ 1][0][krow]);
            out[1] = max_nan(m[1], sh.red_key[which][wg ^ 1][0][krow + 8]);
            return make_float2(out[0], out[1]);
        };
        // Codes of a warp's 16 keys x 32 queries into a [64 keys][64 q] tile, 64-byte rows (this half's 32 bytes).
        auto store_codes = [&](i8* tile, const float (&x)[NT][4], const float (&inv)[2]) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = krow + 8 * half;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const u32 two = (quant_byte(x[n][2 * half], inv[half]) & 0xffu) |
                                    (quant_byte(x[n][2 * half + 1], inv[half]) & 0xffu) << 8;
                    const int col = 32 * qh + 8 * n + 2 * t;
                    *reinterpret_cast<unsigned short*>(tile + row * 64 + ((col >> 4) ^ (row >> 1 & 3)) * 16 + (col & 15)) =
                        static_cast<unsigned short>(two);
                }
            }
        };
        float fac_v[2];
        {
            float m[2];
            row_max<false>(m, p);
            const float2 mm = EXP_PAIR ? pair_max(0, m) : make_float2(m[0], m[1]);
            const Psi p0 = psi_unsigned(mm.x), p1 = psi_unsigned(mm.y);
            const float inv[2] = {p0.inv, p1.inv};
            fac_v[0] = p0.scale * s_do;
            fac_v[1] = p1.scale * s_do;
            store_codes(sh.pt[kb], p, inv);
        }
        if (EXP_DP_LATE) issue_dp();
        wgmma_wait<0>();
        wgmma_hold_all(ds);
        ds_from_dp(ds, p, stats_s, 0, t, a);
        float fac_k[2];
        {
            float m[2];
            row_max<true>(m, ds);
            const float2 mm = EXP_PAIR ? pair_max(1, m) : make_float2(m[0], m[1]);
            const Psi z0 = psi(mm.x), z1 = psi(mm.y);
            const float inv[2] = {z0.inv, z1.inv};
            const float s_qt = sh.stats[slot][0].w;
            fac_k[0] = z0.scale * s_qt;
            fac_k[1] = z1.scale * s_qt;
            store_codes(sh.zt[kb], ds, inv);
        }
        // Ŷ per query over the key block's 64 keys: the warp's 16, then the warpgroup's four warps.
        {
            float colmax[8];
#pragma unroll
            for (int y = 0; y < 8; ++y) colmax[y] = max_nan(fabsf(ds[y / 2][y % 2]), fabsf(ds[y / 2][2 + y % 2]));
            const float m = spread_max8(colmax, g);
            const int yc = (g >> 1) * 8 + 2 * t + (g & 1);
            sh.red_y[wg][wv][yc] = m;
            named_barrier<128>(5 + wg);
            float my = sh.red_y[wg][0][yc];
#pragma unroll
            for (int w = 1; w < 4; ++w) my = max_nan(my, sh.red_y[wg][w][yc]);
            const Psi ys = psi(my);
            if (wv == 0) sh.yscale[kb][32 * qh + yc] = ys.scale * a.kt_scale[seq.k_block0(hk) + j * 2 + kb];
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float inv = __shfl_sync(0xffffffffu, ys.inv, (2 * n + c) * 4 + t);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int q = 32 * qh + 8 * n + 2 * t + c, key = kb * BKV + krow + 8 * half;
                        sh.ds[q * 128 + ((key >> 4) ^ (q & 7)) * 16 + (key & 15)] =
                            static_cast<i8>(quant_byte(ds[n][2 * half + c], inv) & 0xffu);
                    }
                }
        }
        fence_proxy_async();
        named_barrier<256>(1 + kb);  // both halves' P̂ᵀ and Ẑᵀ are in

        // dV and dK of the warpgroup's 64 keys x head-dim half qh: A (the codes) and B from shared memory.
        // dV or dK: its 32-column chunks FLIGHT at a time in flight, each folded as it completes.
        auto rows_products = [&](float (&acc)[CH][4][4], const i8* a_tile, u32 b_lo, const float (&fac)[2]) {
            constexpr int FLIGHT = EXP_PIPE ? CH : 1;
#pragma unroll
            for (int c0 = 0; c0 < CH; c0 += FLIGHT) {
                int pr[FLIGHT][4][4];
                wgmma_fence();
#pragma unroll
                for (int f = 0; f < FLIGHT; ++f) {
#pragma unroll
                    for (int kk = 0; kk < 2; ++kk)
                        wgmma_s8_ss(pr[f], wgmma_desc<64>(wgmma_desc_lo<64>(smem_u32(a_tile)), 32 * kk),
                                    wgmma_desc<64>(b_lo, (qh * DH + (c0 + f) * 32) * BQ + 32 * kk), kk);
                    wgmma_commit();
                }
#pragma unroll
                for (int f = 0; f < FLIGHT; ++f) {
                    if (f + 1 < FLIGHT) wgmma_wait<1>(); else wgmma_wait<0>();
                    wgmma_hold_all(pr[f]);
#pragma unroll
                    for (int n = 0; n < 4; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[c0 + f][n][e] = fmaf(static_cast<float>(pr[f][n][e]), fac[e >> 1], acc[c0 + f][n][e]);
                }
            }
        };
        const u32 dot_lo = wgmma_desc_lo<64>(st + BQ * DP + DP * BQ), qt_lo = wgmma_desc_lo<64>(st + BQ * DP);
        rows_products(dv, sh.pt[kb], dot_lo, fac_v);
        rows_products(dk, sh.zt[kb], qt_lo, fac_k);

        __syncthreads();  // every warpgroup's Ŷ and scales are in; the last dQ reduction has read its tile
        if (tid == 0) bulk_wait_read<0>();
        {
            // SB_DQ_SERIAL: one key block's product in flight at a time (16 registers instead of 32).
            const u32 ds_lo = wgmma_desc_lo<128>(smem_u32(sh.ds));
            const u32 kt_lo = wgmma_desc_lo<128>(smem_u32(sh.kt)) + 32 * wg * 128 / 16;
            const int rows = wv * 16 + g;
            float* dq_row = sh.dq + rows * DQ_PITCH + 32 * wg + 2 * t;
            float acc[4][4];
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                int pq[4][4];
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 2; ++kk)
                    wgmma_s8_ss(pq, wgmma_desc<128>(ds_lo, 64 * k2 + 32 * kk), wgmma_desc<128>(kt_lo, 64 * k2 + 32 * kk), kk);
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_hold_all(pq);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float f = sh.yscale[k2][rows + 8 * half];
#pragma unroll
                    for (int n = 0; n < 4; ++n)
#pragma unroll
                        for (int c = 0; c < 2; ++c)
                            acc[n][2 * half + c] = k2 ? fmaf(static_cast<float>(pq[n][2 * half + c]), f, acc[n][2 * half + c])
                                                      : static_cast<float>(pq[n][2 * half + c]) * f;
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int n = 0; n < 4; ++n)
                    *reinterpret_cast<float2*>(dq_row + half * 8 * DQ_PITCH + 8 * n) = make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
        }
        fence_proxy_async();
        pending_row = seq.q_row0(h) + q0;
    }
    __syncthreads();
    if (tid == 0 && pending_row >= 0) {
        bulk_reduce_add_f32(a.dq_acc + pending_row * DQ_PITCH, smem_u32(sh.dq), BQ * DQ_PITCH * 4);
        bulk_commit();
        bulk_wait_read<0>();
    }
    // dK (ln 2) and dV of this thread's keys x the warpgroup's head-dim half.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = j * CTA_KEYS + kb * BKV + krow + 8 * half;
        if (key >= seq.len_k()) continue;
        u16* kr = a.dk + seq.key_token(a.kb, a.kh, a.kn, hk, key);
        u16* vr = a.dv + seq.key_token(a.wb, a.wh, a.wn, hk, key);
#pragma unroll
        for (int c = 0; c < CH; ++c)
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int col = qh * DH + c * 32 + n * 8 + 2 * t;
                if (col >= a.D) continue;
                *reinterpret_cast<u32*>(kr + col) = pack2_f32<SB_BF16>(dk[c][n][2 * half] * 0.6931471805599453f,
                                                                      dk[c][n][2 * half + 1] * 0.6931471805599453f);
                *reinterpret_cast<u32*>(vr + col) = pack2_f32<SB_BF16>(dv[c][n][2 * half], dv[c][n][2 * half + 1]);
            }
    }
}
