// SageBwd forward on Hopper (sm_90a), warp-specialized: the numerics of forward.cu's 128-key wgmma
// kernel (numerics.py; the same products, scales, lazy rescaling and P̂ codes, so the same bits with
// 128-key tiles), in the structure of a producer/consumer pipeline.
//   Warpgroup 0, the producer: gives its registers back (setmaxnreg) and one thread issues the TMA
//   loads of each key tile (K̂, V̂ᵀ by tensor map, the key scales by a bulk copy) into a ring of
//   SB_KV_STAGES stages, each with a "full" mbarrier (bytes landed) and an "empty" one (every
//   consumer warp done with it).
//   Warpgroups 1..SB_CONSUMERS, the consumers: 64 query rows each, which they quantize themselves
//   (forward_parts.cuh). Per tile j a consumer issues S_j = Q̂K̂_jᵀ and then (P̂V̂)_{j-1}, both
//   asynchronous, and runs tile j's softmax while the second product is in flight; then it folds
//   (P̂V̂)_{j-1} into O, rescales O for tile j's reference max and codes P̂_j. The order of every FP32
//   operation on O and l is forward.cu's, so the results are bit for bit its results.
//   SB_PINGPONG (several consumers): the consumers take turns to issue their products (named
//   barriers, round robin), so that one's softmax runs while another's products occupy the tensor cores.
// Work tiles (CTA_Q query rows of one head and batch entry) come from a static schedule: CTA x takes
// tiles x, x + gridDim.x, ... (a grid of one CTA per tile, or a persistent grid of a CTA per SM,
// whose producer loads the next tile's keys while the consumers finish the last one). Causal
// schedules start with every (head, batch entry)'s last query block (the longest), heads fastest;
// others go query block fastest, so that CTAs running together read one key head.
//
// Compile-time parameters: SB_DP (64, 128 or 256: two consumers, one product at a time), SB_BF16, SB_CAUSAL,
// SB_VARLEN as in forward.cu (no Q-smoothing); SB_CONSUMERS (1-3), SB_KV_STAGES (2-4), SB_PINGPONG; and from specs.WsForwardTiles:
// SB_TILE_KEYS (128, or 192: three V scale blocks a tile, P̂'s row scale and O's rescale once per 192
// keys, numerics.py's forward with key_tile 192), SB_THREADS, SB_CTA_Q, SB_MIN_BLOCKS (CTAs an SM), and
// the key tiles' TMA swizzles SB_TMA_SWIZZLE_K and SB_TMA_SWIZZLE_VT (WsForwardTiles.key_maps).
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "convert.cuh"
#include "exp2.cuh"
#include "forward_parts.cuh"

#ifndef SB_CONSUMERS
#define SB_CONSUMERS 2
#endif
#ifndef SB_KV_STAGES
#define SB_KV_STAGES 3
#endif
#ifndef SB_PINGPONG
#define SB_PINGPONG 1
#endif

constexpr int DP = SB_DP;
constexpr int BKV = SB_BLOCK_KV;             // keys per V scale block
constexpr int TILE = SB_TILE_KEYS;           // keys per tile
constexpr int VBLOCKS = TILE / BKV;          // V scale blocks per tile
constexpr int CONSUMERS = SB_CONSUMERS;
constexpr int STAGES = SB_KV_STAGES;
constexpr int WG_ROWS = 64;                  // query rows per consumer
constexpr int CTA_Q = SB_CTA_Q;              // query rows per CTA
constexpr int THREADS = SB_THREADS;
static_assert(CTA_Q == CONSUMERS * WG_ROWS && THREADS == (CONSUMERS + 1) * 128, "a producer and the consumers' warpgroups");
static_assert(TILE == 128 || (TILE == 192 && !SB_VARLEN), "128-key tiles, or 192 in dense batches");
// The key tiles' TMA boxes in the swizzle of their rows (the wgmma descriptors'): K̂ a whole tile (at d=256 two
// boxes, one a 128-byte column chunk: swizzle.cuh's layout), V̂ᵀ boxes of VT_BOX keys (the whole 128-key tile;
// 64-key boxes of a 192-key tile, whose rows no swizzle spans).
constexpr int K_BOX = SB_TMA_SWIZZLE_K, K_BOXES = DP / K_BOX;
constexpr int VT_BOX = SB_TMA_SWIZZLE_VT, VT_BOXES = TILE / VT_BOX;
static_assert(K_BOX == (DP > 128 ? 128 : DP) && VT_BOX == (TILE == 128 ? 128 : 64), "each box in the swizzle of its rows");
static_assert(DP <= 128 || (TILE == 128 && CONSUMERS == 2), "d=256: 128-key tiles, two consumers");
constexpr int KSTEPS_D = DP / 32;            // k-steps of S over the head dim
constexpr int NT_KV = TILE / 8;              // n-tiles of S over the key tile
constexpr int KSTEPS_P = TILE / 32;          // k-steps of P̂V̂ over the key tile
constexpr int NT_D = DP / 8;                 // n-tiles of O over the head dim
constexpr bool PINGPONG = SB_PINGPONG && CONSUMERS > 1;
// S_j in flight with (P̂V̂)_{j-1} inside each consumer (registers for both products): with one or two
// consumers; three hold one product at a time at their 160 registers, and so do 192-key tiles at head dim 128.
// At d=256 O's 128 registers leave one product at a time too.
constexpr bool OVERLAP = CONSUMERS < 3 && (TILE == 128 || DP == 64) && DP <= 128;
static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
static_assert(STAGES >= 2 && STAGES <= 4, "2-4 key-tile stages");
static_assert(BKV == 64 && VBLOCKS * BKV == TILE, "whole V scale blocks a tile");
// Registers: the producer keeps 24; the consumers take the rest of the SM's 64K (one CTA an SM with
// two or three consumers; with one, two CTAs an SM: specs.WsForwardTiles.ctas_per_sm).
constexpr int MIN_BLOCKS = SB_MIN_BLOCKS;
static_assert(MIN_BLOCKS == (CONSUMERS == 1 ? 2 : 1), "CONSUMER_REGS below are the split of one or two CTAs' registers");
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 232 : CONSUMERS == 2 ? 240 : 160;
// setmaxnreg moves registers inside the CTA's allocation, which the launch sizes from the kernel's
// register count (launch bounds: 64K over the CTAs' threads, in steps of 8).
constexpr int LAUNCH_REGS = 65536 / (MIN_BLOCKS * THREADS) / 8 * 8;
static_assert((PRODUCER_REGS + CONSUMERS * CONSUMER_REGS) * 128 <= LAUNCH_REGS * THREADS, "the CTA's registers");

// Shared memory: the consumers' Q̂ tiles, then the stages (K̂ [TILE][DP], V̂ᵀ [DP][TILE]), the stages' K scales
// (kept apart, so that at d=256 three stages fit), then the mbarriers. wgmma and TMA tiles start on 1024 bytes.
struct WsStage {
    i8 k[TILE * DP];
    i8 vt[DP * TILE];
};
struct WsShared {
    i8 q[CTA_Q * DP];
    WsStage stage[STAGES];
    float k_scale[STAGES][TILE];
    unsigned long long full[STAGES];   // the stage's bytes are in (one arrival: the producer's)
    unsigned long long empty[STAGES];  // every consumer warp is done with it
};
constexpr unsigned long long DYNAMIC_SHARED_BYTES = sizeof(WsShared) + 1024;  // + slack to align the base
constexpr int Q_BYTES = sizeof(WsShared::q);
constexpr int K_BYTES = sizeof(WsStage::k);
constexpr int V_BYTES = sizeof(WsStage::vt);
constexpr int KS_BYTES = 4 * TILE;
constexpr int STAGE_BYTES = sizeof(WsStage);
constexpr int KS_OFF = Q_BYTES + STAGES * STAGE_BYTES;
constexpr int BAR_OFF = KS_OFF + STAGES * KS_BYTES;
constexpr u32 STAGE_LOAD_BYTES = K_BYTES + V_BYTES;  // and the tile's key scales (key_scale_bytes)
static_assert(STAGE_BYTES == K_BYTES + V_BYTES && KS_BYTES % 16 == 0 && sizeof(WsShared) == BAR_OFF + 16 * STAGES,
              "no padding");
static_assert(Q_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0 && K_BYTES % 1024 == 0, "tiles start on 1024 bytes");
// Named barriers (0 is __syncthreads): a consumer's own (its Q̂ tile), and its turn to issue (ping-pong).
constexpr int BAR_Q = 1, BAR_TURN = BAR_Q + CONSUMERS;

constexpr float PL = SB_P_LEVELS;             // P̂ codes above zero (numerics.P_LEVELS)
constexpr float LAZY_LOG2 = 8.f;              // forward.cu: lazy rescaling
constexpr float M_NONE = -1e30f;              // forward.cu: m_ref before any key
#define NEG_INF (-__int_as_float(0x7f800000))

template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// A work tile: query block qb (CTA_Q rows) of head h and batch entry b (WsForwardParams's order).
struct WorkTile {
    int qb, h, b;
};
SB_DEVICE WorkTile work_tile(int t, int heads, int batch, int q_blocks) {
    if (SB_CAUSAL) {
        const int r = t / heads;
        return {q_blocks - 1 - r / batch, t - r * heads, r % batch};
    }
    const int r = t / q_blocks;
    return {t - r * q_blocks, r % heads, r / heads};
}

// Key tiles a work tile reads (forward.cu's rule for its CTA_Q rows).
SB_DEVICE int key_tiles(const SeqInfo<ForwardParams>& seq, int q0) {
    int n = (seq.len_k() + TILE - 1) / TILE;
    const int last = q0 + CTA_Q - 1 + seq.causal_shift();  // the CTA's last row's last key (causal)
    if (SB_CAUSAL) n = last < 0 ? 0 : min(n, last / TILE + 1);
    if (SB_VARLEN && q0 >= seq.len_q()) n = 0;
    return n;
}

// Key tiles that rows first_row .. first_row + 63 read (causal: up to the last row's diagonal).
SB_DEVICE int consumer_tiles(const SeqInfo<ForwardParams>& seq, int first_row) {
    const int last = first_row + WG_ROWS - 1 + seq.causal_shift();
    if (SB_VARLEN && first_row >= seq.len_q()) return 0;
    return !SB_CAUSAL ? (seq.len_k() + TILE - 1) / TILE : last < 0 ? 0 : last / TILE + 1;
}

// Turns a consumer takes to issue the products of n key tiles (ping-pong): one a tile and one for the
// last P̂V̂ when S and P̂V̂ overlap, two a tile otherwise.
SB_DEVICE int issue_turns(int n) { return OVERLAP ? (n > 0 ? n + 1 : 0) : 2 * n; }

// Key tile j's scales in bytes: a 192-key tile may pass the head's Nk_pad keys (a multiple of 128), whose
// scales end there (the K̂ and V̂ᵀ boxes past it read the next head's codes, or zeros at the end: masked keys).
SB_DEVICE u32 key_scale_bytes(int j, int nk_pad) { return 4 * (TILE == 128 ? TILE : min(TILE, nk_pad - j * TILE)); }

// The TMA maps of the key-side tiles: tm_k, tm_vt (params.cuh SB_FORWARD_MAPS, encoded per call by
// sagebwd_cp/tensor_map.py); the schedule's shape: SB_FORWARD_SCHEDULE.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
attention_forward(SB_KERNEL_PARAMS(SB_FORWARD_FIELDS), SB_KERNEL_MAPS(SB_FORWARD_MAPS)
                      SB_KERNEL_PARAMS_MORE(SB_FORWARD_SCHEDULE)) {
    const ForwardParams p = SB_KERNEL_VIEW(ForwardParams, SB_FORWARD_FIELDS);
    SB_REQUIRE_SM80();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned char* smem = smem_raw + (base - smem_u32(smem_raw));
    const int work = q_blocks_ * p.Hq * batch_;

    const u32 sStage = base + Q_BYTES;
    const u32 full0 = base + BAR_OFF, empty0 = full0 + 8 * STAGES;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(full0 + 8 * s, 1);
            mbarrier_init(empty0 + 8 * s, 4 * CONSUMERS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the only CTA-wide barrier: the producer's warps leave below

    const int wg = warpgroup_uniform();
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            prefetch_tensor_map(tm_k);
            prefetch_tensor_map(tm_vt);
            int it = 0;  // key tiles loaded so far: stage it % STAGES, its use it / STAGES
            for (int t = blockIdx.x; t < work; t += gridDim.x) {
                const WorkTile w = work_tile(t, p.Hq, batch_, q_blocks_);
                const SeqInfo<ForwardParams> seq(p, w.b);
                const int hk = seq.kv_head(w.h), n_tiles = key_tiles(seq, w.qb * CTA_Q);
                const int krow0 = static_cast<int>(seq.k_row0(hk));
                const int vt_row = static_cast<int>(seq.kt_row0(hk, DP)), vt_col = seq.kt_col0();
                const float* ksg = p.k_scale + seq.k_row0(hk);
                for (int j = 0; j < n_tiles; ++j, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) mbarrier_wait(empty0 + 8 * s, ((it / STAGES) & 1) ^ 1);
                    const u32 st = sStage + s * STAGE_BYTES, bar = full0 + 8 * s;
                    const u32 ks_bytes = key_scale_bytes(j, p.Nk_pad);
                    mbarrier_arrive_expect_tx(bar, STAGE_LOAD_BYTES + ks_bytes);
#pragma unroll
                    for (int b = 0; b < K_BOXES; ++b) tma_load_2d(st + b * TILE * K_BOX, tm_k, b * K_BOX, krow0 + j * TILE, bar);
#pragma unroll
                    for (int b = 0; b < VT_BOXES; ++b)
                        tma_load_2d(st + K_BYTES + b * DP * VT_BOX, tm_vt, vt_col + j * TILE + b * VT_BOX, vt_row, bar);
                    bulk_load(base + KS_OFF + s * KS_BYTES, ksg + j * TILE, ks_bytes, bar);
                }
            }
            // Leave once the consumers have taken every stage in flight.
            for (int i = max(it - STAGES, 0); i < it; ++i) mbarrier_wait(empty0 + 8 * (i % STAGES), (i / STAGES) & 1);
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();

    // ---- consumer c: rows 64c .. 64c + 63 of each work tile ----
    const int c = wg - 1;
    const int ctid = threadIdx.x - 128 * wg;
    const int lane = threadIdx.x & 31, wv = ctid >> 5;
    const int g = lane >> 2, t = lane & 3;  // the lane's row in 8 and column pair in each n-tile
    const u32 sQ = base + c * WG_ROWS * DP;
    const u32 q_desc = wgmma_desc_lo<DP>(sQ);
    // One turn of the ping-pong: a consumer issues its products between taking its turn and passing
    // it on, round robin from consumer 0; the last consumer's first pass is made up front, and
    // consumer 0 takes the pass left over from the last one's final turn before it leaves.
    auto take_turn = [&] { if (PINGPONG) named_barrier<256>(BAR_TURN + c); };
    auto pass_turn = [&] { if (PINGPONG) named_barrier_arrive<256>(BAR_TURN + (c + 1) % CONSUMERS); };
    if (PINGPONG && c == CONSUMERS - 1) named_barrier_arrive<256>(BAR_TURN);
    int it0 = 0;  // key tiles consumed before this work tile (the producer's count)

    for (int wt = blockIdx.x; wt < work; wt += gridDim.x) {
    const WorkTile w = work_tile(wt, p.Hq, batch_, q_blocks_);
    const int h = w.h;
    const SeqInfo<ForwardParams> seq(p, w.b);
    const int hk = seq.kv_head(h), q0 = w.qb * CTA_Q, shift = seq.causal_shift();
    const int n_tiles = key_tiles(seq, q0);
    if (SB_VARLEN && q0 >= seq.len_q()) continue;  // packed: the schedule covers the longest sequence
    const int qc0 = q0 + WG_ROWS * c;
    // The tiles this consumer's rows read: under the causal mask the first consumers stop before the
    // CTA's last tile (whose stage they give back unread, below).
    const int n_c = min(n_tiles, consumer_tiles(seq, qc0));
    // The last work tile's products have all completed: its Q̂ tile may be written again.
    const float q_row_scale = quantize_q_rows<DP, true, WG_ROWS>(sQ, p.q + seq.token(p.q_sb, p.q_sh, p.q_sn, h, 0), p.q_sn, qc0,
                                                             seq.len_q(), p.D, p.q_prescale, ctid);
    fence_proxy_async();          // the Q̂ stores, before wgmma reads them
    named_barrier<128>(BAR_Q + c);
    // forward.cu: row r of the tile was quantized by lanes 2r, 2r + 1 of its warp; a zero row's scale
    // as the smallest subnormal.
    float qs[2];
    qs[0] = max_nan(__shfl_sync(0xffffffffu, q_row_scale, 2 * g), __int_as_float(1));
    qs[1] = max_nan(__shfl_sync(0xffffffffu, q_row_scale, 2 * g + 16), __int_as_float(1));
    const int rbase = qc0 + wv * 16 + g;  // this thread's rows: rbase, rbase + 8
    float o[NT_D][4];
#pragma unroll
    for (int n = 0; n < NT_D; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_ref[2] = {M_NONE, M_NONE}, l_run[2] = {0.f, 0.f};
    u32 pf[KSTEPS_P][4];           // P̂ of the tile whose P̂V̂ is next
    float pv_factor[2] = {0.f, 0.f};  // (β/255)·s_V of that tile, per row
    float alpha[2];
    bool moved[2];  // the row's reference max moved with the tile just taken (O rebased)
    const float* vsg = p.v_scale + seq.k_block0(hk);

    // Tile j's stage is in; its V scales into sv.
    auto wait_tile = [&](int j, float (&sv)[VBLOCKS]) {
        mbarrier_wait(full0 + 8 * ((it0 + j) % STAGES), ((it0 + j) / STAGES) & 1);
#pragma unroll
        for (int vb = 0; vb < VBLOCKS; ++vb)  // (a 192-key tile's blocks past Nk_pad: none, scale 0)
            sv[vb] = TILE == 128 || (j * VBLOCKS + vb) * BKV < p.Nk_pad ? vsg[j * VBLOCKS + vb] : 0.f;
    };
    auto issue_s = [&](int j, int (&acc)[NT_KV][4]) {
        const u32 k_lo = wgmma_desc_lo<DP>(sStage + ((it0 + j) % STAGES) * STAGE_BYTES);
#pragma unroll
        for (int ks = 0; ks < KSTEPS_D; ++ks)
            wgmma_s8_ss(acc, wgmma_desc<DP>(q_desc, kstep_offset<DP, WG_ROWS>(ks)), wgmma_desc<DP>(k_lo, kstep_offset<DP, TILE>(ks)), ks);
        wgmma_commit();
    };
    // (P̂V̂) of tile jp, head-dim columns 64·dh .. 64·dh + 63, from the P̂ codes in pf: k-step kk in V̂ᵀ box
    // 32·kk / VT_BOX ([DP][VT_BOX] each), 32·kk % VT_BOX bytes into its rows.
    auto issue_pv = [&](int jp, int dh, int (&acc)[8][4]) {
        const u32 v_lo = wgmma_desc_lo<VT_BOX>(sStage + ((it0 + jp) % STAGES) * STAGE_BYTES + K_BYTES);
#pragma unroll
        for (int kk = 0; kk < KSTEPS_P; ++kk)
            wgmma_rs<true>(acc, pf[kk], wgmma_desc<VT_BOX>(v_lo, 32 * kk / VT_BOX * DP * VT_BOX + dh * 64 * VT_BOX + 32 * kk % VT_BOX), kk);
        wgmma_commit();
    };
    auto fold_pv = [&](int dh, int (&acc)[8][4]) {
        wgmma_hold_all(acc);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[8 * dh + n][e] = fmaf(static_cast<float>(acc[n][e]), pv_factor[e >> 1], o[8 * dh + n][e]);
    };
    // The P̂V̂ of tile jp is folded: its stage goes back (P̂'s registers were read until here).
    auto release = [&](int jp) {
#pragma unroll
        for (int kk = 0; kk < KSTEPS_P; ++kk)
#pragma unroll
            for (int x = 0; x < 4; ++x) wgmma_hold(pf[kk][x]);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty0 + 8 * ((it0 + jp) % STAGES));
    };
    // Tile j's softmax on its scores acc (forward.cu, numerics: the running max): the exponents in u,
    // m_ref, l_run and alpha updated, P̂'s coefficients in pcoef and the tile's O factor in pv_next.
    auto softmax = [&](int j, const float (&sv)[VBLOCKS], int (&acc)[NT_KV][4], float (&u)[NT_KV][4],
                       float (&pcoef)[VBLOCKS], float (&pv_next)[2]) {
        wgmma_hold_all(acc);
        float pv_scale;
        p_coefficients<VBLOCKS, BKV>(sv, j * VBLOCKS, seq.len_k(), PL, pcoef, pv_scale);
        const float* ks_s = reinterpret_cast<const float*>(smem + KS_OFF + ((it0 + j) % STAGES) * KS_BYTES);
        const bool need_mask = (j + 1) * TILE > seq.len_k() || (SB_CAUSAL && (j + 1) * TILE - 1 > qc0 + shift);
        float rmax[2] = {NEG_INF, NEG_INF};
        // u = Ŝ·s_K[key], masked keys -inf; the mask's tests only on the tiles that need them (a branch
        // around two copies of the loop: as one loop the compiler keeps the tests on every tile).
        auto scale_scores = [&](auto masked) {
#pragma unroll
            for (int n = 0; n < NT_KV; ++n) {
                const float2 ksn = *reinterpret_cast<const float2*>(ks_s + n * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int half = e >> 1, key = j * TILE + n * 8 + 2 * t + (e & 1);
                    const float x = static_cast<float>(acc[n][e]) * ((e & 1) ? ksn.y : ksn.x);
                    u[n][e] = !decltype(masked)::value || (key < seq.len_k() && (!SB_CAUSAL || key <= rbase + 8 * half + shift))
                                  ? x : NEG_INF;
                    rmax[half] = fmaxf(rmax[half], u[n][e]);
                }
            }
        };
        if (need_mask) scale_scores(Flag<true>{});
        else scale_scores(Flag<false>{});
        float r_use[2], beta[2];
#pragma unroll
        for (int half = 0; half < 2; ++half)
            moved[half] = tile_row_max(rmax[half], qs[half], true, LAZY_LOG2, m_ref[half], alpha[half], beta[half], r_use[half]);
        float rsum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < NT_KV; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int half = e >> 1;
                const float x = exp2_approx(fmaf(u[n][e], qs[half], -r_use[half]));
                u[n][e] = x;
                rsum[half] += x;
            }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            l_run[half] = fmaf(beta[half], rsum[half], alpha[half] * l_run[half]);
            pv_next[half] = beta[half] * pv_scale;
        }
    };
    // O to the reference max of the tile just taken (where some row's moved: warp-uniform branch).
    auto rebase_o = [&] {
        if (__any_sync(0xffffffffu, moved[0] || moved[1])) {
#pragma unroll
            for (int n = 0; n < NT_D; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
        }
    };
    // (P̂V̂) of tile jp into O, the first 64 columns' product already issued into acc; the later columns'
    // products run while `between` works (P̂ of the next tile is coded there).
    auto finish_pv = [&](int jp, int (&acc)[8][4], auto between) {
        wgmma_wait<0>();
        fold_pv(0, acc);
#pragma unroll
        for (int dh = 1; dh < DP / 64; ++dh) {
            int acc2[8][4];
            wgmma_fence();
            issue_pv(jp, dh, acc2);
            if (dh == 1) between();
            wgmma_wait<0>();
            fold_pv(dh, acc2);
        }
        if (DP == 64) between();
        release(jp);
    };

    if (OVERLAP && n_c > 0) {
        // Tile 0: S alone.
        {
            float sv[VBLOCKS], u[NT_KV][4], pcoef[VBLOCKS], pv_next[2];
            int acc[NT_KV][4];
            wait_tile(0, sv);
            take_turn();
            wgmma_fence();
            issue_s(0, acc);
            pass_turn();
            wgmma_wait<0>();
            softmax(0, sv, acc, u, pcoef, pv_next);
            rebase_o();
            pv_factor[0] = pv_next[0];
            pv_factor[1] = pv_next[1];
            code_p<NT_KV, BKV>(u, pcoef, pf);
        }
        // Tile j: S_j and the first columns of (P̂V̂)_{j-1} in flight, then tile j's softmax.
        for (int j = 1; j < n_c; ++j) {
            float sv[VBLOCKS], u[NT_KV][4], pcoef[VBLOCKS], pv_next[2];
            int acc[NT_KV][4], pv[8][4];
            u32 pf_next[KSTEPS_P][4];
            wait_tile(j, sv);
            take_turn();
            wgmma_fence();
            issue_s(j, acc);
            issue_pv(j - 1, 0, pv);
            pass_turn();
            wgmma_wait<1>();
            softmax(j, sv, acc, u, pcoef, pv_next);
            finish_pv(j - 1, pv, [&] { code_p<NT_KV, BKV>(u, pcoef, pf_next); });
            rebase_o();
            pv_factor[0] = pv_next[0];
            pv_factor[1] = pv_next[1];
#pragma unroll
            for (int kk = 0; kk < KSTEPS_P; ++kk)
#pragma unroll
                for (int x = 0; x < 4; ++x) pf[kk][x] = pf_next[kk][x];
        }
        // The last tile's P̂V̂.
        {
            int pv[8][4];
            take_turn();
            wgmma_fence();
            issue_pv(n_c - 1, 0, pv);
            pass_turn();
            finish_pv(n_c - 1, pv, [] {});
        }
    }
    // One product at a time (forward.cu's order): S_j, its softmax, O rebased, P̂_j coded, (P̂V̂)_j folded.
    for (int j = 0; !OVERLAP && j < n_c; ++j) {
        float sv[VBLOCKS], u[NT_KV][4], pcoef[VBLOCKS], pv_next[2];
        int acc[NT_KV][4], pv[8][4];
        wait_tile(j, sv);
        take_turn();
        wgmma_fence();
        issue_s(j, acc);
        pass_turn();
        wgmma_wait<0>();
        softmax(j, sv, acc, u, pcoef, pv_next);
        rebase_o();
        pv_factor[0] = pv_next[0];
        pv_factor[1] = pv_next[1];
        code_p<NT_KV, BKV>(u, pcoef, pf);
        take_turn();
        wgmma_fence();
        issue_pv(j, 0, pv);
        pass_turn();
        finish_pv(j, pv, [] {});
    }
    // Tiles past this consumer's rows: their stages go back once loaded (a stage's use is released
    // in order), and the turns the other consumers take for them are passed on.
    for (int j = n_c; j < n_tiles; ++j) {
        mbarrier_wait(full0 + 8 * ((it0 + j) % STAGES), ((it0 + j) / STAGES) & 1);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty0 + 8 * ((it0 + j) % STAGES));
    }
    for (int turn = issue_turns(n_c); turn < issue_turns(n_tiles); ++turn) {
        take_turn();
        pass_turn();
    }

    // O = acc / l and the base-2 LSE (forward_parts.cuh).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = rbase + 8 * half;
        store_row<SB_BF16>(o, half, l_run[half], m_ref[half], row < seq.len_q(), p.Dv, t,
                           [&] { return p.out + seq.token(p.ob, p.oh, p.on, h, row); }, p.lse2,
                           [&] { return seq.lse_row0(h) + row; });
    }
    it0 += n_tiles;
    }
    if (PINGPONG && c == 0) take_turn();  // the last consumer's final pass
}
