// Symmetric INT8 quantization (ψ of numerics.py) of Q, K (per token) and V, dO (per 64-token block), writing every
// layout the later products read: row-major [B][H][N_pad][D_pad] (reduction over d) and/or the
// transposed copy [B][H][D_pad][N_pad] (reduction over tokens), optionally with the tokens of
// each group of 16 stored in the register-fragment order (numerics.KEY_PERMUTATION_16).
// Entries: quantize_tensors (up to three tensors in one launch) and token_sum (the float64 token
// sums behind μ_K).
//
// Compile-time: SB_BF16 (input dtype), SB_BLOCK_Q / SB_BLOCK_KV (rows per block of V and dO).
#include "common.cuh"
#include "convert.cuh"

#ifndef SB_BF16
#define SB_BF16 0
#endif
#define QBLOCK 64
#define QTHREADS 256
#define MAX_DPAD 128
#define QUANT_PERMUTE_T 1
#define QUANT_PER_TOKEN 2

static_assert(SB_BLOCK_Q == QBLOCK && SB_BLOCK_KV == QBLOCK, "one quantization block size for every tensor");

// Stored position p (within 16) holds token KEY_PERMUTATION_16[p].
SB_DEVICE int permuted_token(int p) {
    const int q = p & 15, t = q >> 2, e = q & 3;
    return (p & ~15) + 2 * t + (e & 1) + 8 * (e >> 1);
}

SB_DEVICE float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < QTHREADS / 32; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

// ψ of a block with max|x| = amax (numerics.quantize_block): stores the scale amax/127 at `scale`
// (when given) and returns the inverse 127/amax; a block under TINY_AMAX counts as zero (1 and 0).
SB_DEVICE float psi_inverse(float amax, float* scale) {
    const bool zero = amax < SB_TINY_AMAX;
    if (scale) *scale = zero ? 1.f : div_rn(amax, 127.f);
    return zero ? 0.f : div_rn(127.f, amax);
}

// The INT8 code of x with inverse scale inv (numerics.quantize_block: rint(x·inv), clamped), as a byte.
SB_DEVICE u32 int8_code(float x, float inv) {
    return static_cast<u32>(max(-127, min(127, rint_s32(mul_rn(x, inv))))) & 0xffu;
}

// Per-token scales and only the row-major layout (the forward's Q̂ and K̂): each row stays in the
// registers of DPAD/8 lanes (8 values each, one 16-byte load), its max by shuffles, no shared tile
// and no barrier, every load of the block in flight at once. The same arithmetic as quantize_block.
template <int DPAD>
SB_DEVICE void quantize_rows_streaming(const u16* __restrict__ xs, i64 sn, int nvalid, int D, float prescale,
                                       const float* mu, i8* __restrict__ rows_out, float* __restrict__ scale_out) {
    constexpr int LANES = DPAD / 8, ROWS_PER_WARP = 32 / LANES, ROWS_PER_PASS = ROWS_PER_WARP * QTHREADS / 32;
    constexpr int PASSES = QBLOCK / ROWS_PER_PASS;
    const int lane = threadIdx.x & 31, c0 = (lane % LANES) * 8;
    const int r0 = (threadIdx.x >> 5) * ROWS_PER_WARP + lane / LANES;
    uint4 w[PASSES];
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        const int r = r0 + k * ROWS_PER_PASS;
        w[k] = r < nvalid && c0 < D ? *reinterpret_cast<const uint4*>(xs + static_cast<i64>(r) * sn + c0)
                                    : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
        const int r = r0 + k * ROWS_PER_PASS;
        const u32 words[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
        float v[8], amax = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            v[e] = 0.f;
            if (r < nvalid && c0 < D) {
                v[e] = mul_rn(to_f32<SB_BF16>(static_cast<u16>(words[e >> 1] >> (16 * (e & 1)))), prescale);
                if (mu) v[e] = sub_rn(v[e], mu[c0 + e]);
            }
            amax = fmaxf(amax, fabsf(v[e]));
        }
#pragma unroll
        for (int o = 1; o < LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float inv = psi_inverse(amax, lane % LANES == 0 ? scale_out + r : nullptr);
        u32 packed[2] = {0, 0};
#pragma unroll
        for (int e = 0; e < 8; ++e)
            packed[e >> 2] |= int8_code(v[e], inv) << (8 * (e & 3));
        *reinterpret_cast<uint2*>(rows_out + static_cast<i64>(r) * DPAD + c0) = make_uint2(packed[0], packed[1]);
    }
}

// One CTA quantizes one block of 64 rows (blk) of one (batch b, head h).
// x: 16-bit input with strides (in elements) sb, sh, sn and unit stride along d.
// prescale multiplies every value first (c*log2(e) for Q, 1 otherwise).
// mean_sum (optional, [B][H][D_pad] float64 token sums): μ = float32(sum / N) is subtracted after
//   the prescale (K-smoothing); the CTA of block 0 stores μ in mean_out.
// block_mean_out (optional, [B][H][N_pad/64][D_pad]): subtract and store the block's own mean
//   over its valid rows (Q-smoothing).
// rows_out / t_out (optional): the two layouts.
// flags: QUANT_PERMUTE_T stores t_out in the fragment token order; QUANT_PER_TOKEN gives every row its
//   own scale (scale_out [B][H][N_pad]) instead of one per block (scale_out [B][H][N_pad/64]).
SB_DEVICE void quantize_block(const u16* __restrict__ x, i64 sb, i64 sh, i64 sn, int H, int N, int D, int D_pad,
                              int N_pad, float prescale, const double* __restrict__ mean_sum,
                              float* __restrict__ mean_out, float* __restrict__ block_mean_out,
                              i8* __restrict__ rows_out, i8* __restrict__ t_out, int flags,
                              float* __restrict__ scale_out, int blk, int h, int b) {
    __shared__ float tile[QBLOCK][MAX_DPAD + 1];
    __shared__ double colsum[QTHREADS];
    __shared__ float red[QTHREADS / 32];
    __shared__ float mu[MAX_DPAD];
    __shared__ float row_inv[QBLOCK];
    const int row0 = blk * QBLOCK;
    const int nvalid = max(0, min(QBLOCK, N - row0));
    const u16* xs = x + b * sb + h * sh;
    const i64 bh = static_cast<i64>(b) * H + h;
    if (mean_sum && threadIdx.x < D_pad) {
        const float m = threadIdx.x < D ? static_cast<float>(mean_sum[bh * D_pad + threadIdx.x] / static_cast<double>(N)) : 0.f;
        mu[threadIdx.x] = m;
        if (blk == 0) mean_out[bh * D_pad + threadIdx.x] = m;
    }
    __syncthreads();

    const bool aligned = D % 8 == 0 && sn % 8 == 0 && (reinterpret_cast<size_t>(xs) & 15) == 0;
    if ((flags & QUANT_PER_TOKEN) && aligned && !t_out && !block_mean_out && (D_pad == 64 || D_pad == 128)) {
        i8* rows = rows_out + (bh * N_pad + row0) * D_pad;
        float* scales = scale_out + bh * N_pad + row0;
        const float* m = mean_sum ? mu : nullptr;
        if (D_pad == 64) quantize_rows_streaming<64>(xs + static_cast<i64>(row0) * sn, sn, nvalid, D, prescale, m, rows, scales);
        else quantize_rows_streaming<128>(xs + static_cast<i64>(row0) * sn, sn, nvalid, D, prescale, m, rows, scales);
        return;
    }

    // Load (prescaled, mean-subtracted) values; padding rows and columns are 0. Rows that start
    // 16-byte aligned are read 8 values per load (D is then a multiple of 8: a chunk is all in or out).
    auto put = [&](int r, int c, u16 raw) {
        float v = 0.f;
        if (r < nvalid && c < D) {
            v = mul_rn(to_f32<SB_BF16>(raw), prescale);
            if (mean_sum) v = sub_rn(v, mu[c]);
        }
        tile[r][c] = v;
    };
    if (aligned) {
        const int chunks = D_pad / 8;
        for (int i = threadIdx.x; i < QBLOCK * chunks; i += QTHREADS) {
            const int r = i / chunks, c0 = (i % chunks) * 8;
            uint4 w = make_uint4(0, 0, 0, 0);
            if (r < nvalid && c0 < D) w = *reinterpret_cast<const uint4*>(xs + static_cast<i64>(row0 + r) * sn + c0);
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) put(r, c0 + e, static_cast<u16>(words[e >> 1] >> (16 * (e & 1))));
        }
    } else {
        for (int i = threadIdx.x; i < QBLOCK * D_pad; i += QTHREADS) {
            const int r = i / D_pad, c = i % D_pad;
            put(r, c, r < nvalid && c < D ? xs[static_cast<i64>(row0 + r) * sn + c] : u16(0));
        }
    }
    __syncthreads();

    if (block_mean_out) {
        // Column means over the valid rows in float64 (exact for realistic ranges, so the
        // emulator's order of summation gives the same float32 mean).
        const int per_col = QTHREADS / D_pad;
        const int c = threadIdx.x % D_pad, part = threadIdx.x / D_pad;
        double s = 0.0;
        for (int r = part; r < nvalid; r += per_col) s += static_cast<double>(tile[r][c]);
        colsum[threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.x < D_pad) {
            double t = 0.0;
            for (int p = 0; p < per_col; ++p) t += colsum[p * D_pad + threadIdx.x];
            const float m = (c < D && nvalid > 0) ? static_cast<float>(t / static_cast<double>(nvalid)) : 0.f;
            block_mean_out[(bh * (N_pad / QBLOCK) + blk) * D_pad + threadIdx.x] = m;
            colsum[threadIdx.x] = m;  // reused as the float32 mean
        }
        __syncthreads();
        for (int i = threadIdx.x; i < QBLOCK * D_pad; i += QTHREADS) {
            const int r = i / D_pad, c = i % D_pad;
            if (r < nvalid && c < D) tile[r][c] = sub_rn(tile[r][c], static_cast<float>(colsum[c]));
        }
        __syncthreads();
    }

    if (flags & QUANT_PER_TOKEN) {
        // One scale per row: four threads per row, each over every fourth column.
        static_assert(QTHREADS == 4 * QBLOCK, "four threads per row");
        const int r = threadIdx.x >> 2;
        float amax = 0.f;
        for (int c = threadIdx.x & 3; c < D_pad; c += 4) amax = fmaxf(amax, fabsf(tile[r][c]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        if ((threadIdx.x & 3) == 0) row_inv[r] = psi_inverse(amax, scale_out + bh * N_pad + row0 + r);
    } else {
        float amax = 0.f;
        for (int i = threadIdx.x; i < QBLOCK * D_pad; i += QTHREADS) amax = fmaxf(amax, fabsf(tile[i / D_pad][i % D_pad]));
        amax = block_max(amax, red);
        float* scale = scale_out + bh * (N_pad / QBLOCK) + blk;
        if (threadIdx.x < QBLOCK) row_inv[threadIdx.x] = psi_inverse(amax, threadIdx.x == 0 ? scale : nullptr);
    }
    __syncthreads();

    // Round and write, sixteen bytes per store (rows of D_pad and blocks of 64 tokens are multiples of 16).
    auto code = [&](int r, int c) {
        return int8_code(tile[r][c], row_inv[r]);
    };
    if (rows_out) {
        i8* out = rows_out + (bh * N_pad + row0) * D_pad;
        for (int i = threadIdx.x; i < QBLOCK * D_pad / 16; i += QTHREADS) {
            const int r = (16 * i) / D_pad, c = (16 * i) % D_pad;
            u32 w[4] = {0, 0, 0, 0};
#pragma unroll
            for (int e = 0; e < 16; ++e) w[e >> 2] |= code(r, c + e) << (8 * (e & 3));
            reinterpret_cast<uint4*>(out)[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    if (t_out) {
        i8* out = t_out + bh * D_pad * N_pad + row0;
        for (int i = threadIdx.x; i < D_pad * QBLOCK / 16; i += QTHREADS) {
            const int c = (16 * i) / QBLOCK, p = (16 * i) % QBLOCK;
            u32 w[4] = {0, 0, 0, 0};
#pragma unroll
            for (int e = 0; e < 16; ++e) w[e >> 2] |= code((flags & QUANT_PERMUTE_T) ? permuted_token(p + e) : p + e, c) << (8 * (e & 3));
            *reinterpret_cast<uint4*>(out + static_cast<i64>(c) * N_pad + p) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// One tensor of a quantize_tensors launch: quantize_block's arguments, and its CTA count
// (N_pad / 64 blocks times H heads; 0 for an absent tensor).  Pointers first, then 8-byte, then
// 4-byte fields: no padding, so the host packs it field by field (sagebwd_cp/forward.py).
struct QuantizeJob {
    const u16* x;
    const double* mean_sum;
    float* mean_out;
    float* block_mean_out;
    i8* rows_out;
    i8* t_out;
    float* scale_out;
    i64 sb, sh, sn;
    int H, N, N_pad, flags;
    float prescale;
    int ctas;
};
static_assert(sizeof(QuantizeJob) == 7 * 8 + 3 * 8 + 6 * 4, "QuantizeJob: the host packs it without padding");

// Up to three tensors (Q, K, V for the forward; Q, K, dO for the backward) in one launch: blockIdx.x
// runs over a's CTAs, then b's, then c's; blockIdx.z is the batch.  Each CTA computes exactly what
// a launch of one tensor computed for its (block, head).
extern "C" __global__ void __launch_bounds__(QTHREADS)
quantize_tensors(QuantizeJob a, QuantizeJob b, QuantizeJob c, int D, int D_pad) {
    SB_REQUIRE_SM80();
    int cta = blockIdx.x;
    const int which = cta < a.ctas ? 0 : (cta < a.ctas + b.ctas ? 1 : 2);
    cta -= which == 0 ? 0 : (which == 1 ? a.ctas : a.ctas + b.ctas);
    // Field by field selects (no pointer to a parameter, so nothing goes to local memory).
#define SB_JOB(field) (which == 0 ? a.field : (which == 1 ? b.field : c.field))
    const int blocks = SB_JOB(N_pad) / QBLOCK;
    quantize_block(SB_JOB(x), SB_JOB(sb), SB_JOB(sh), SB_JOB(sn), SB_JOB(H), SB_JOB(N), D, D_pad, SB_JOB(N_pad),
                   SB_JOB(prescale), SB_JOB(mean_sum), SB_JOB(mean_out), SB_JOB(block_mean_out), SB_JOB(rows_out),
                   SB_JOB(t_out), SB_JOB(flags), SB_JOB(scale_out), cta % blocks, cta / blocks, blockIdx.z);
#undef SB_JOB
}

// Partial token sums for μ_K: one CTA per 256 tokens of one (batch, head) adds its float64 column
// sums into sum_out ([B][H][D_pad], zeroed by the caller). The sums of 16-bit values are exact in
// float64 for realistic ranges, so the atomics' order does not matter.  With one CTA per
// (batch, head) (N <= 256) the CTA stores its sum (0 + t == t), so sum_out needs no zeroing.
#define MEAN_TOKENS 256
extern "C" __global__ void __launch_bounds__(QTHREADS)
token_sum(const u16* __restrict__ x, i64 sb, i64 sh, i64 sn, int H, int N, int D, int D_pad,
          double* __restrict__ sum_out) {
    SB_REQUIRE_SM80();
    __shared__ double part[QTHREADS * 8];
    const int n0 = blockIdx.x * MEAN_TOKENS, h = blockIdx.y, b = blockIdx.z;
    const u16* xs = x + b * sb + h * sh;
    const int n1 = min(N, n0 + MEAN_TOKENS);
    // Aligned rows: each thread sums 8 columns from 16-byte loads; else one column per thread.
    const bool vec = D % 8 == 0 && sn % 8 == 0 && (reinterpret_cast<size_t>(xs) & 15) == 0;
    const int width = vec ? 8 : 1, groups = D_pad / width, slices = QTHREADS / groups;
    const int c0 = (threadIdx.x % groups) * width, slice = threadIdx.x / groups;
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (c0 < D) {
        if (vec) {
            for (int n = n0 + slice; n < n1; n += slices) {
                const uint4 w = *reinterpret_cast<const uint4*>(xs + static_cast<i64>(n) * sn + c0);
                const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int e = 0; e < 8; ++e) s[e] += static_cast<double>(to_f32<SB_BF16>(static_cast<u16>(words[e >> 1] >> (16 * (e & 1)))));
            }
        } else {
#pragma unroll 8
            for (int n = n0 + slice; n < n1; n += slices) s[0] += static_cast<double>(to_f32<SB_BF16>(xs[static_cast<i64>(n) * sn + c0]));
        }
    }
    // part[slice][column]
#pragma unroll
    for (int e = 0; e < 8; ++e)
        if (e < width) part[slice * D_pad + c0 + e] = s[e];
    __syncthreads();
    if (threadIdx.x < D) {
        double t = 0.0;
        for (int p = 0; p < slices; ++p) t += part[p * D_pad + threadIdx.x];
        double* dst = sum_out + (static_cast<i64>(b) * H + h) * D_pad + threadIdx.x;
        if (gridDim.x == 1)
            *dst = t;
        else
            atomicAdd(dst, t);
    }
}
