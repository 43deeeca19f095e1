// Symmetric INT8 quantization (ψ of numerics.py) of Q, K (per token) and V, dO (per 64-token block), writing every
// layout the later products read: row-major [B][H][N_pad][D_pad] (reduction over d) and/or the
// transposed copy [B][H][D_pad][N_pad] (reduction over tokens), optionally with the tokens of
// each group of 16 stored in the register-fragment order (numerics.KEY_PERMUTATION_16).
// Entries: quantize_tensors (up to three tensors in one launch) and token_sum (the float64 token
// sums behind μ_K). A thread's raw chunks come by cp.async into its own slots of shared memory, and
// it codes them itself (quantize_blocks): the row-major codes go out from its registers, the transposed ones
// through a tile the CTA shares, as whole 128-byte rows; the other barriers are for per-block maxima and
// Q-smoothing's means at D_pad = 128.
//
// Compile-time: SB_DP (the padded head dim, D_pad), SB_BF16 (input dtype), SB_BLOCK_Q / SB_BLOCK_KV (rows per block of
// V and dO); from specs.py
// SB_QUANT_THREADS (quantize_tensors' largest CTA: D_pad threads), SB_QUANT_CHUNKS (tokens a thread owns),
// SB_SUM_THREADS (token_sum's CTA) and SB_TOKEN_PAD.
#include "common.cuh"
#include "params.cuh"
#include "convert.cuh"
#include "cp_async.cuh"
#include "quantizer.cuh"
#include "seqinfo.cuh"

#define QBLOCK 64
#define QUANT_PERMUTE_T 1
#define QUANT_PER_TOKEN 2
#define QUANT_MEAN_GIVEN 4
#define QUANT_FUSED_SUM 8

static_assert(SB_BLOCK_Q == QBLOCK && SB_BLOCK_KV == QBLOCK, "one quantization block size for every tensor");
constexpr int D_PAD = SB_DP;                     // the module's head dim, padded
static_assert(D_PAD == 64 || D_PAD == 128 || D_PAD == 256, "the head dim padded to 64, 128 or 256");
// quantize_tensors: D_pad threads a CTA (two blocks of 64 tokens); launch bounds of at least SB_QUANT_THREADS
constexpr int QTHREADS_MAX = D_PAD > SB_QUANT_THREADS ? D_PAD : SB_QUANT_THREADS;
constexpr int SUM_THREADS = SB_SUM_THREADS;     // token_sum
static_assert(QTHREADS_MAX >= D_PAD, "D_pad threads a CTA");
static_assert(SB_TOKEN_PAD % (2 * QBLOCK) == 0, "a CTA's two blocks lie in one tensor's padded rows");

// Byte transpose: words a, b, c, d hold bytes 0-3 of four tokens; out[n] holds byte n of each, in that order.
SB_DEVICE void transpose_bytes(u32 a, u32 b, u32 c, u32 d, u32 (&out)[4]) {
    const u32 ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
    const u32 cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
    out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
    out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
    out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
    out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

constexpr int GROUP = SB_QUANT_CHUNKS;  // tokens a thread owns (one group of the fragment token order)
static_assert(GROUP == 16, "a thread's tokens are one group of the fragment token order");
// Sized for the module's head dim (its CTAs have D_PAD threads): at d=64 a quarter of d=128's, so that
// shared memory admits more CTAs an SM. COLSUM_ROWS: colsum's rows, a warp's each where an entry sums columns across
// warps (Q-smoothing's block means, two warps a block at D_PAD = 128; the fused token sums, whose warps at D_PAD = 256
// share a row in two rounds: FUSED_COLSUM_ROWS), else one, unread: at D_PAD = 256 quantize_tensors then fits three
// CTAs an SM instead of two (16 KB less each), and quantize_tensors_fused three (8 KB less).
template <int COLSUM_ROWS>
struct QuantizeShared {
    static constexpr int ROWS = COLSUM_ROWS;
    float red[D_PAD / 32];                     // warp maxima (per-block scales at DPAD = 128)
    union {
        double colsum[COLSUM_ROWS][D_PAD];     // column sums, a warp's (or two warps') each
        float mean[D_PAD];                     // μ per column (K-smoothing from token_sum's parts)
    };
    int ticket;                                // QUANT_FUSED_SUM: the CTA's place among its head's arrivals
};
// Q-smoothing's block means over more than one warp need the rows (the host refuses Q-smoothing above head dim 128).
constexpr bool QSMOOTH_COLSUMS = D_PAD == 128;
constexpr int FUSED_COLSUM_ROWS = D_PAD == 256 ? D_PAD / 64 : D_PAD / 32;

// Two blocks of 64 tokens of one tensor (flat index 2·cta + i over (head, block); every tensor has an
// even number, N_pad being a multiple of 128), DPAD threads. A thread owns GROUP = 16 tokens x 8
// columns: the DPAD/8 lanes of a token group are adjacent and 4 groups make a block. Its 16 chunks
// of 16 bytes come by cp.async into its own column of a shared tile (no registers held while they
// fly, all in flight at once) and are read twice, a row at a time, for the maxima and for the codes;
// a row is stored as 8 bytes as it is coded, and its codes for the transposed copy take its slot,
// whence the group's 16 rows are transposed into 16-byte column pieces, which the CTA stores as whole rows.
// x: 16-bit input with strides (in elements) sb, sh, sn and unit stride along d.
// prescale multiplies every value first (c*log2(e) for Q, 1 otherwise).
// mean_sum (optional, [B][H][sum_parts][DPAD] float64 partial token sums, token_sum's): μ = float32(sum / N)
//   is subtracted after the prescale (K-smoothing); the CTA holding block 0 stores μ in mean_out ([B][H][D]). With
//   QUANT_MEAN_GIVEN instead, mean_out already holds μ (a saved forward's) and is only read.
// block_mean_out (optional, [B][H][N_pad/64][DPAD]): subtract and store the block's own mean
//   over its valid rows (Q-smoothing). At most one of mean_sum and block_mean_out.
// rows_out / t_out (optional): the two layouts.
// flags: QUANT_PERMUTE_T stores t_out in the fragment token order; QUANT_PER_TOKEN gives every row its
//   own scale (scale_out [B][H][N_pad]) instead of one per block (scale_out [B][H][N_pad/64]);
//   QUANT_MEAN_GIVEN: see mean_sum; QUANT_FUSED_SUM: see sum_part.
// sum_part, arrive (QUANT_FUSED_SUM, quantize_tensors_fused's K job; QuantizeParams): μ from this launch's own
//   loads, K read once (no token_sum launch). Each CTA stores its float64 column sums in sum_part ([B][H][sum_parts][DPAD], sum_parts the
//   head's CTAs) and counts itself in arrive[b·H + h] (zeroed before the launch); the head's last CTA to arrive adds
//   the parts in order, stores μ in mean_out and raises the count to sum_parts + 1; the others wait for that and read
//   μ from mean_out. Waiting is safe where the head's CTAs are consecutive in the grid (they are), the hardware
//   starts CTAs in grid order (as the deterministic backward's turns assume too) and the device holds a head's CTAs
//   at once (quantize.py fused_token_sums).
// t_scale_out (optional, with QUANT_PER_TOKEN): t_out is coded per block instead, with its scale stored
//   there ([B][H][N_pad/64]; the backward's transposed Q̂ and K̂: numerics.py).
// Rows past N and columns past D are zero in every layout, with scale 0 where they fill a scale's row or block.
// raw: GROUP x DPAD chunks of 16 bytes (dynamic shared memory, 16·GROUP·D_pad bytes: quantize.py), chunk i of
//   thread t at [i][t], so a warp's reads are conflict-free.
// PRESCALE: prescale != 1; SHIFT: the job subtracts μ or block means; MEAN_GIVEN (with SHIFT, without
// PRESCALE): μ is read from mean_out (quantize_tensors picks them).
template <int DPAD, bool PRESCALE, bool SHIFT, bool MEAN_GIVEN = false, bool FUSED_SUM = false, class Shared>
SB_DEVICE void quantize_blocks(Shared& sm, uint4* raw, const u16* __restrict__ x, i64 sb, i64 sh, i64 sn, int H, int N,
                               int D, int N_pad, float prescale, const double* __restrict__ mean_sum, double* sum_part,
                               int* arrive, int sum_parts,
                               float* __restrict__ mean_out, float* __restrict__ block_mean_out,
                               i8* __restrict__ rows_out, i8* __restrict__ t_out, int flags,
                               float* __restrict__ scale_out, float* __restrict__ t_scale_out, int cta, int b,
                               const int* __restrict__ cu, int seq_pad, int seq_rows) {
    constexpr int L = DPAD / 8, TPB = 4 * L, WARPS_PER_BLOCK = TPB / 32;
    static_assert(TPB % 32 == 0, "a block is whole warps");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = tid % TPB / L, c0 = 8 * (tid % L);
    const int blocks = (SB_VARLEN ? seq_rows : N_pad) / QBLOCK, fb = 2 * cta + tid / TPB;
    const int h = fb / blocks, blk = fb % blocks;
    const i64 bh = static_cast<i64>(b) * H + h;
    // The (batch, head)'s first row in the row-major buffers and scales, its first element (column 0) in
    // the transposed one, and its 16-bit rows: [B][H][N_pad] rows, or packed (seqinfo.cuh) [1][H][N_pad]
    // rows with this sequence's from varlen_row0 and its tokens from cu[b] of [total][H][D].
    i64 row0 = bh * N_pad, t0 = bh * DPAD * N_pad;
    const u16* xs = x + b * sb + h * sh;
    if (SB_VARLEN) {
        const int start = cu[b];
        N = cu[b + 1] - start;
        // The CTA's two blocks (one head, 128 rows) lie both inside or both past the sequence's padded rows.
        if (blk * QBLOCK >= (N + seq_pad - 1) / seq_pad * seq_pad) return;
        const i64 first = varlen_row0(start, b, seq_pad);
        row0 = h * static_cast<i64>(N_pad) + first;
        t0 = h * static_cast<i64>(DPAD) * N_pad + first;
        xs = x + static_cast<i64>(start) * sn + h * sh;
    }
    const int tok0 = blk * QBLOCK + grp * GROUP;  // the thread's first token

    // What each column subtracts after the prescale: μ (K-smoothing) or the block's mean (Q-smoothing,
    // below); a job has at most one of them, and x - 0 is x, so one branch-free formula serves all.
    float shift[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) shift[e] = MEAN_GIVEN && c0 + e < D ? mean_out[bh * D + c0 + e] : 0.f;
    if (!MEAN_GIVEN && SHIFT && mean_sum) {
        // μ from token_sum's parts ([B][H][sum_parts][DPAD]), once a CTA: thread c adds column c's parts (a CTA
        // has DPAD threads, its two blocks one head); the CTA whose first block is 0 stores μ. Before the chunks'
        // copies are issued: after them, NVRTC 13.0 spilled on sm_80-89 or kept a stack frame on sm_90, and it
        // measured no faster.
        const int c = tid;
        const double* part = mean_sum + bh * sum_parts * DPAD + c;
        double sum = 0.0;
#pragma unroll 4
        for (int p = 0; p < sum_parts; ++p) sum += part[p * DPAD];
        const float m = c < D ? static_cast<float>(sum / static_cast<double>(N)) : 0.f;
        sm.mean[c] = m;
        if (blk == tid / TPB && c < D) mean_out[bh * D + c] = m;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; ++e) shift[e] = sm.mean[c0 + e];
    }
    // Raw 16-bit values, zero outside the tensor. Rows that start 16-byte aligned are copied 8 values
    // at a time (D is then a multiple of 8: a chunk is all in or out); others value by value.
    if (rows_aligned_16(xs, sn, D)) {
#pragma unroll
        for (int i = 0; i < GROUP; ++i) {
            const bool ok = tok0 + i < N && c0 < D;
            cp_async_16(smem_u32(&raw[i * DPAD + tid]), ok ? xs + static_cast<i64>(tok0 + i) * sn + c0 : xs, ok ? 16 : 0);
        }
        cp_async_commit();
    } else {  // rolled: a rare path, and unrolled it took a third of the file's compile time
#pragma unroll 1
        for (int i = 0; i < GROUP; ++i) {
            u16* dst = reinterpret_cast<u16*>(&raw[i * DPAD + tid]);
#pragma unroll 1
            for (int e = 0; e < 8; ++e) dst[e] = tok0 + i < N && c0 + e < D ? xs[static_cast<i64>(tok0 + i) * sn + c0 + e] : u16(0);
        }
    }

    cp_async_wait<0>();  // the thread's own chunks: visible to it without a barrier

    if (FUSED_SUM) {
        // μ from the chunks just loaded (sum_part above). Column sums of the thread's 16 rows (zero past N and D), then
        // of the CTA's eight token groups: lanes L apart, then warps (in rounds of Shared::ROWS warps, each adding into
        // a row of its own). float64 sums of 16-bit values are exact for realistic ranges, so this order gives
        // token_sum's μ.
        double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
#pragma unroll 1
        for (int i = 0; i < GROUP; ++i) {
            const uint4 r = raw[i * DPAD + tid];
            const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] += static_cast<double>(to_f32<SB_BF16>(static_cast<u16>(words[e >> 1] >> (16 * (e & 1)))));
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
#pragma unroll
            for (int m = L; m < 32; m <<= 1) s[e] += __shfl_xor_sync(0xffffffffu, s[e], m);
        constexpr int ROWS = Shared::ROWS;
        static_assert(DPAD / 32 % ROWS == 0, "whole rounds of warps");
#pragma unroll
        for (int round = 0; round < DPAD / 32 / ROWS; ++round) {
            if (warp / ROWS == round && lane < L)
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    double& row = sm.colsum[warp % ROWS][c0 + e];
                    row = round == 0 ? s[e] : row + s[e];
                }
            __syncthreads();
        }
        const int c = tid, part = blk / 2;  // this thread's column; the CTA's place in its head (blocks 2·part, +1)
        double sum = sm.colsum[0][c];
#pragma unroll
        for (int w = 1; w < ROWS; ++w) sum += sm.colsum[w][c];
        double* parts = sum_part + bh * sum_parts * DPAD + c;
        parts[part * DPAD] = sum;
        __syncthreads();  // every column's part is stored (also: colsum is read, mean may be written)
        if (tid == 0) {
            __threadfence();  // (cumulative: the CTA's stores, ordered before it by the barrier)
            sm.ticket = atomicAdd(arrive + bh, 1);
            __threadfence();
        }
        __syncthreads();
        float m;
        if (sm.ticket == sum_parts - 1) {  // the last: every part is stored
            // The parts in order, eight loads in flight.
            sum = 0.0;
            for (int q0 = 0; q0 < sum_parts; q0 += 8) {
                double v[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) v[q] = q0 + q < sum_parts ? __ldcg(parts + (q0 + q) * DPAD) : 0.0;
#pragma unroll
                for (int q = 0; q < 8; ++q) sum += v[q];
            }
            m = c < D ? static_cast<float>(sum / static_cast<double>(N)) : 0.f;
            if (c < D) mean_out[bh * D + c] = m;
            __syncthreads();
            if (tid == 0) {
                __threadfence();
                st_release_gpu(arrive + bh, sum_parts + 1);
            }
        } else {
            if (tid == 0)
                while (ld_acquire_gpu(arrive + bh) <= sum_parts) __nanosleep(64);
            __syncthreads();
            m = c < D ? __ldcg(mean_out + bh * D + c) : 0.f;
        }
        sm.mean[c] = m;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; ++e) shift[e] = sm.mean[c0 + e];
    }

    const int rows_in = N - tok0;  // the thread's rows inside the tensor

    if (SHIFT && DPAD <= 128 && block_mean_out) {  // (Q-smoothing: at most head dim 128, QSMOOTH_COLSUMS)
        // Column means over the block's valid rows in float64 (exact for realistic ranges, so any
        // order of summation gives the emulator's float32 mean): the thread's 16 rows, then its
        // block's four groups (lanes L and 2L apart; two warps at DPAD = 128).
        double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        for (int i = 0; i < GROUP; ++i) {
            float v[8];
            row_values<PRESCALE, false>(raw[i * DPAD + tid], prescale, shift, v);  // zero past N and D
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] += static_cast<double>(v[e]);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
#pragma unroll
            for (int m = L; m < 32; m <<= 1) s[e] += __shfl_xor_sync(0xffffffffu, s[e], m);
        if (WARPS_PER_BLOCK > 1) {
            if (lane < L)
#pragma unroll
                for (int e = 0; e < 8; ++e) sm.colsum[warp][c0 + e] = s[e];
            __syncthreads();
            const int w0 = warp / WARPS_PER_BLOCK * WARPS_PER_BLOCK;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                s[e] = sm.colsum[w0][c0 + e];
#pragma unroll
                for (int k = 1; k < WARPS_PER_BLOCK; ++k) s[e] += sm.colsum[w0 + k][c0 + e];
            }
        }
        const int nvalid = max(0, min(QBLOCK, N - blk * QBLOCK));
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            shift[e] = c0 + e < D && nvalid > 0 ? static_cast<float>(s[e] / static_cast<double>(nvalid)) : 0.f;
            if (grp == 0) block_mean_out[(row0 / QBLOCK + blk) * DPAD + c0 + e] = shift[e];
        }
    }

    // Row maxima of |value|, two rows an iteration (as the codes' loop below), 0 past N. Without a shift, on
    // the raw 16-bit values: rounding is monotonic and prescale > 0, so max|RN(x·p)| = RN(max|x|·p), and rows past
    // N are zero. Per token, the group's L lanes combine each row's max and lane j keeps rows j·OWN.. (one or two;
    // at D_pad = 256 a group's 32 lanes outnumber its 16 rows, and lanes 16-31 keep none),
    // whose scales it forms; every thread keeps the max over its rows for the block's scale.
    const bool per_token = flags & QUANT_PER_TOKEN;
    constexpr int OWN = GROUP / L > 0 ? GROUP / L : 1, OWNERS = GROUP / OWN;  // OWNERS: the lanes that keep rows
    static_assert(OWN == 1 || OWN == 2, "a lane owns the scales of one or two rows");
    float own_max[OWN], thread_max = 0.f;
#pragma unroll
    for (int x = 0; x < OWN; ++x) own_max[x] = 0.f;
#pragma unroll 2
    for (int i = 0; i < GROUP; ++i) {
        float m = 0.f;
        if (SHIFT) {
            float v[8];
            row_values<PRESCALE, SHIFT>(raw[i * DPAD + tid], prescale, shift, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) m = max_nan(m, fabsf(v[e]));
            m = i < rows_in ? m : 0.f;
        } else {
            m = chunk_abs_max(raw[i * DPAD + tid]);
            if (PRESCALE) m = mul_rn(m, prescale);
        }
        thread_max = max_nan(thread_max, m);
        if (per_token) {
#pragma unroll
            for (int o = 1; o < L; o <<= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
            if (i / OWN == lane % L) {
                if (OWN == 1 || i % 2 == 0) own_max[0] = m;
                else own_max[OWN - 1] = m;
            }
        }
    }
    // The block's max|value| from the threads' (a barrier at DPAD = 128: two warps a block).
    auto block_amax = [&] {
        float amax = thread_max;
#pragma unroll
        for (int m = 1; m < 32; m <<= 1) amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, m));
        if (WARPS_PER_BLOCK > 1) {
            if (lane == 0) sm.red[warp] = amax;
            __syncthreads();
            const int w0 = warp / WARPS_PER_BLOCK * WARPS_PER_BLOCK;
            amax = sm.red[w0];
#pragma unroll
            for (int k = 1; k < WARPS_PER_BLOCK; ++k) amax = max_nan(amax, sm.red[w0 + k]);
        }
        return amax;
    };
    float t_inv = 0.f;  // with t_scale_out: the transposed codes' inverse scale
    float own_inv[OWN], block_inv = 0.f;
    if (per_token) {
        if (t_scale_out) t_inv = psi_inverse(block_amax(), tid % TPB == 0 ? t_scale_out + row0 / QBLOCK + blk : nullptr);
#pragma unroll
        for (int x = 0; x < OWN; ++x)
            own_inv[x] = psi_inverse(own_max[x], lane % L < OWNERS ? scale_out + row0 + tok0 + (lane % L) * OWN + x : nullptr);
    } else {
        block_inv = psi_inverse(block_amax(), tid % TPB == 0 ? scale_out + row0 / QBLOCK + blk : nullptr);
    }

    // Codes, row by row: the rows are stored as they are coded, and with t_out the codes t_out takes
    // (the same, or with t_scale_out the block's, from the same values) replace the row's raw chunk, which is
    // not read again. Two rows an iteration, so that their shuffles and stores overlap (1.00-1.02x over one); 16
    // unrolled rows were more code than the instruction cache kept for the CTAs of an SM ("no instruction" stalls).
    const int group_lane0 = lane - lane % L;
#pragma unroll 2
    for (int i = 0; i < GROUP; ++i) {
        float row_inv = i < rows_in ? block_inv : 0.f;  // rows past N code 0 (per token: amax 0)
        if (per_token) row_inv = __shfl_sync(0xffffffffu, OWN == 1 || i % 2 == 0 ? own_inv[0] : own_inv[OWN - 1], group_lane0 + i / OWN);
        float v[8];
        row_values<PRESCALE, SHIFT>(raw[i * DPAD + tid], prescale, shift, v);
        const uint2 c = chunk_codes(v, row_inv);
        if (rows_out) *reinterpret_cast<uint2*>(rows_out + (row0 + tok0 + i) * DPAD + c0) = c;
        if (t_out) *reinterpret_cast<uint2*>(&raw[i * DPAD + tid]) = t_scale_out ? chunk_codes(v, i < rows_in ? t_inv : 0.f) : c;
    }
    if (t_out) {
        // Stored position 4k + n of the group holds row 4k + n, or 2k + (n & 1) + 8(n >> 1) in the fragment
        // order (numerics.KEY_PERMUTATION_16).
        u32 code[GROUP][2];
#pragma unroll
        for (int i = 0; i < GROUP; ++i) {
            const uint2 c = *reinterpret_cast<const uint2*>(&raw[i * DPAD + tid]);
            code[i][0] = c.x;
            code[i][1] = c.y;
        }
        u32 col[8][4];
        const bool permute = flags & QUANT_PERMUTE_T;
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                u32 t4[4];
                if (permute)
                    transpose_bytes(code[2 * k][half], code[2 * k + 1][half], code[2 * k + 8][half], code[2 * k + 9][half], t4);
                else
                    transpose_bytes(code[4 * k][half], code[4 * k + 1][half], code[4 * k + 2][half], code[4 * k + 3][half], t4);
#pragma unroll
                for (int n = 0; n < 4; ++n) col[4 * half + n][k] = t4[n];
            }
        // Out through shared memory as whole 128-byte rows of t_out: a column's 128 tokens (the CTA's two blocks)
        // make one line, where each thread's 16 tokens of a column went out alone before, half a sector each (the
        // pass took 1.3-1.7x its time without those stores). The tile: [DPAD][128] bytes over raw, its 16-byte
        // chunks swizzled by (row / 8) % 8, so that 8 lanes' chunks, written or read, fill the 32 banks.
        __syncthreads();  // every thread has read its codes from raw
        u8* tile = reinterpret_cast<u8*>(raw);
        const int G = tid / L;  // the thread's token group in the CTA: tokens 16·G.. of its 128
        // Rows c0.. (one swizzle: c0 is a multiple of 8), chunk G.
        u8* own = tile + c0 * 128 + 16 * (G ^ ((c0 >> 3) & 7));
#pragma unroll
        for (int e = 0; e < 8; ++e) *reinterpret_cast<uint4*>(own + e * 128) = make_uint4(col[e][0], col[e][1], col[e][2], col[e][3]);
        __syncthreads();
        // Thread t copies chunk t % 8 of rows t / 8 + k·DPAD / 8.
        static_assert(2 * TPB == DPAD, "a thread a head-dim column: the tile's 8·DPAD chunks, 8 each");
        const int j = tid & 7;
        i8* out = t_out + t0 + static_cast<i64>(tid >> 3) * N_pad + (tok0 - 16 * G) + 16 * j;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int row = (tid >> 3) + k * (DPAD / 8);
            *reinterpret_cast<uint4*>(out + static_cast<i64>(k * (DPAD / 8)) * N_pad) =
                *reinterpret_cast<const uint4*>(tile + row * 128 + 16 * (j ^ ((row >> 3) & 7)));
        }
    }
}

// One tensor of a quantize_tensors launch is a QuantizeJob (params.cuh): quantize_blocks' arguments, and
// its CTA count (N_pad / 64 blocks times H heads, two blocks a CTA: quantize.py _quantize_ctas).
// Up to three tensors (Q, K, V for the forward; Q, K, dO for the backward) in one launch: blockIdx.x
// runs over a's CTAs, then b's, then c's; blockIdx.z is the batch; D_pad threads a CTA; sum_parts: the
// parts of the job with mean_sum (token_sum's grid.x). Several CTAs
// per SM (256 bytes of shared memory a thread): one CTA's loads are in flight while the others round and store.
// Floors of CTAs an SM, each where ptxas spilled without it (NVRTC 13.0 or 13.5): five at d=64 and d=128 (96
// registers; at d=128 it took 80 and spilled 4-8 bytes once t_out went through shared memory), three at d=256 (85,
// shared memory's limit for quantize_tensors; it took 64 and spilled 12 bytes). Blackwell: four at d <= 128 (128
// registers), two at d=256 (its packed kernels spilled 12-48 bytes at three and without a floor).
#if SB_DP <= 128 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define SB_QUANT_BOUNDS __launch_bounds__(QTHREADS_MAX, 4)
#elif SB_DP <= 128
#define SB_QUANT_BOUNDS __launch_bounds__(QTHREADS_MAX, 5)
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define SB_QUANT_BOUNDS __launch_bounds__(QTHREADS_MAX, 2)
#else
#define SB_QUANT_BOUNDS __launch_bounds__(QTHREADS_MAX, 3)
#endif
// FUSED: the entry quantize_tensors_fused, for the forward's K (QUANT_FUSED_SUM) and V jobs alone, dense batches:
// an entry of its own, so that the fused sums' registers leave quantize_tensors' alone.
template <bool FUSED>
SB_DEVICE void quantize_jobs(const QuantizeParams p) {
    int cta = blockIdx.x;
    const int which = cta < p.a.ctas ? 0 : (cta < p.a.ctas + p.b.ctas ? 1 : 2);
    cta -= which == 0 ? 0 : (which == 1 ? p.a.ctas : p.a.ctas + p.b.ctas);
    // Field by field selects (no pointer to a parameter, so nothing goes to local memory).
#define SB_JOB(field) (which == 0 ? p.a.field : (which == 1 ? p.b.field : p.c.field))
    __shared__ QuantizeShared<FUSED ? FUSED_COLSUM_ROWS : QSMOOTH_COLSUMS ? D_PAD / 32 : 1> sm;
    extern __shared__ uint4 raw[];
#define SB_JOB_ARGS                                                                                              \
    sm, raw, SB_JOB(x), SB_JOB(sb), SB_JOB(sh), SB_JOB(sn), SB_JOB(H), SB_JOB(N), SB_JOB(D), SB_JOB(N_pad), SB_JOB(prescale),       \
        SB_JOB(mean_sum), FUSED ? p.sum_part : nullptr, FUSED ? p.arrive : nullptr, p.sum_parts, SB_JOB(mean_out),      \
        SB_JOB(block_mean_out), SB_JOB(rows_out), SB_JOB(t_out), SB_JOB(flags),                                        \
        SB_JOB(scale_out), SB_JOB(t_scale_out), cta, static_cast<int>(blockIdx.z), SB_JOB(cu), SB_JOB(seq_pad), SB_JOB(seq_rows)
    // One instantiation per step the job needs (uniform across the CTA); the head dim is the module's.
    const bool prescale = SB_JOB(prescale) != 1.f, shift = SB_JOB(mean_sum) || SB_JOB(block_mean_out);
    // A saved μ_K (the backward's K with the forward's mean; quantize.py passes no prescale with it), or μ_K formed
    // here (the forward's K, dense batches, no prescale).
    if (FUSED) {  // (quantize.py fused_token_sums: K with the flag, V plain, no other job)
        if (SB_JOB(flags) & QUANT_FUSED_SUM)
            quantize_blocks<D_PAD, false, true, false, true>(SB_JOB_ARGS);
        else
            quantize_blocks<D_PAD, false, false>(SB_JOB_ARGS);
    } else if (SB_JOB(flags) & QUANT_MEAN_GIVEN) {
        quantize_blocks<D_PAD, false, true, true>(SB_JOB_ARGS);
    } else if (shift) {
        prescale ? quantize_blocks<D_PAD, true, true>(SB_JOB_ARGS) : quantize_blocks<D_PAD, false, true>(SB_JOB_ARGS);
    } else {
        prescale ? quantize_blocks<D_PAD, true, false>(SB_JOB_ARGS) : quantize_blocks<D_PAD, false, false>(SB_JOB_ARGS);
    }
#undef SB_JOB_ARGS
#undef SB_JOB
}

extern "C" __global__ void SB_QUANT_BOUNDS
quantize_tensors(SB_KERNEL_PARAMS(SB_QUANTIZE_FIELDS)) {
    SB_REQUIRE_SM80();
    const QuantizeParams p = SB_KERNEL_VIEW(QuantizeParams, SB_QUANTIZE_FIELDS);
    quantize_jobs<false>(p);
}

extern "C" __global__ void SB_QUANT_BOUNDS
quantize_tensors_fused(SB_KERNEL_PARAMS(SB_QUANTIZE_FIELDS)) {
    SB_REQUIRE_SM80();
#if SB_VARLEN  // (packed batches keep token_sum: quantize.py fused_token_sums)
    asm volatile("trap;");
#else
    quantize_jobs<true>(SB_KERNEL_VIEW(QuantizeParams, SB_QUANTIZE_FIELDS));
#endif
}

// Zeroes the n arrival counts of quantize_tensors_fused's token sums, before that launch; one CTA.
extern "C" __global__ void __launch_bounds__(SUM_THREADS)
zero_counts(SB_KERNEL_PARAMS(SB_ZERO_COUNTS_FIELDS)) {
    const ZeroCountsParams p = SB_KERNEL_VIEW(ZeroCountsParams, SB_ZERO_COUNTS_FIELDS);
    for (int i = threadIdx.x; i < p.n; i += SUM_THREADS) p.counts[i] = 0;
}

// Partial token sums for μ_K: CTA (part, h, b) sums the tokens [part·span, min(N, (part + 1)·span)) of one
// (batch, head) in float64 and stores them in sum_out[(bh·parts + part)·D_pad + c] (parts = gridDim.x), with no
// atomics and no zeroed buffer; the K job of quantize_tensors adds the parts. The sums of 16-bit values are
// exact in float64 for realistic ranges, so neither order matters. Each thread keeps SUM_UNROLL 16-byte loads
// in flight (the pass is bound by bytes in flight per SM).
#define SUM_UNROLL 4
// Three CTAs an SM: without a floor NVRTC 13.0 gave sm_90 32 registers and spilled.
extern "C" __global__ void __launch_bounds__(SUM_THREADS, 3)
token_sum(SB_KERNEL_PARAMS(SB_TOKEN_SUM_FIELDS)) {
    const TokenSumParams p = SB_KERNEL_VIEW(TokenSumParams, SB_TOKEN_SUM_FIELDS);
    SB_REQUIRE_SM80();
    __shared__ double part[8][SUM_THREADS + 4];
    const int n0 = blockIdx.x * p.span, h = blockIdx.y, b = blockIdx.z;
    // Packed (SB_VARLEN): sequence b's tokens from cu[b]; its parts past its length store zeros.
    const u16* xs = SB_VARLEN ? p.x + static_cast<i64>(p.cu[b]) * p.sn + h * p.sh : p.x + b * p.sb + h * p.sh;
    const int n1 = min(SB_VARLEN ? p.cu[b + 1] - p.cu[b] : p.N, n0 + p.span);
    // Aligned rows: each thread sums 8 columns from 16-byte loads; else one column per thread.
    const bool vec = p.D % 8 == 0 && p.sn % 8 == 0 && (reinterpret_cast<size_t>(xs) & 15) == 0;
    const int width = vec ? 8 : 1, groups = p.D_pad / width, slices = SUM_THREADS / groups;
    const int c0 = (threadIdx.x % groups) * width, slice = threadIdx.x / groups;
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (c0 < p.D) {
        if (vec) {
            for (int n = n0 + slice; n < n1; n += SUM_UNROLL * slices) {
                uint4 w[SUM_UNROLL];
#pragma unroll
                for (int u = 0; u < SUM_UNROLL; ++u) {
                    w[u] = make_uint4(0, 0, 0, 0);
                    if (n + u * slices < n1) w[u] = *reinterpret_cast<const uint4*>(xs + static_cast<i64>(n + u * slices) * p.sn + c0);
                }
#pragma unroll
                for (int u = 0; u < SUM_UNROLL; ++u) {
                    const u32 words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
                    for (int e = 0; e < 8; ++e) s[e] += static_cast<double>(to_f32<SB_BF16>(static_cast<u16>(words[e >> 1] >> (16 * (e & 1)))));
                }
            }
        } else {
#pragma unroll 8
            for (int n = n0 + slice; n < n1; n += slices) s[0] += static_cast<double>(to_f32<SB_BF16>(xs[static_cast<i64>(n) * p.sn + c0]));
        }
    }
    // The slices' sums of each column: value e of thread slice·groups + g is column g·width + e. Rows of
    // part are padded so that the eight values a warp's threads read at once sit in different banks.
#pragma unroll
    for (int e = 0; e < 8; ++e) part[e][threadIdx.x] = s[e];
    __syncthreads();
    if (threadIdx.x < p.D_pad) {  // columns D.. too (zeros), which the K job reads
        const int g = threadIdx.x / width, e = threadIdx.x % width;
        double t = 0.0;
        for (int p = 0; p < slices; ++p) t += part[e][p * groups + g];
        p.sum_out[((static_cast<i64>(b) * p.H + h) * gridDim.x + blockIdx.x) * p.D_pad + threadIdx.x] = t;
    }
}
