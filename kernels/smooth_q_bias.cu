// Q-smoothing's exact FP32 add-back: bias[b][h][i][key] = μ_Q(block i) · (k[key] - μ_K), the part of
// each base-2 logit that subtracting the block mean of Q removed.
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "convert.cuh"

// grid (ceil(Nk_pad / SB_THREADS), ceil(n_qblocks / SB_BIAS_QBLOCKS), B * Hq): a thread per key, SB_BIAS_QBLOCKS query
// blocks a CTA (SB_THREADS, SB_BIAS_QBLOCKS: specs.BIAS_THREADS, BIAS_QBLOCKS). The keys' rows are read once a CTA,
// BIAS_COLS columns at a time, by whole rows (coalesced) into shared memory, transposed so that each thread reads its
// key's column without bank conflicts; each value then serves every query block of the CTA. Each (block, key) is the
// chain fmaf(μ_Q[c], k[c] - μ_K[c], ·) over c = 0 .. D - 1 in order, as one thread's walk over its key's row gives.
constexpr int BIAS_COLS = 32;

extern "C" __global__ void __launch_bounds__(SB_THREADS)
smooth_q_bias(SB_KERNEL_PARAMS(SB_SMOOTH_Q_BIAS_FIELDS)) {
    const SmoothQBiasParams p = SB_KERNEL_VIEW(SmoothQBiasParams, SB_SMOOTH_Q_BIAS_FIELDS);
    SB_REQUIRE_SM80();
    __shared__ float ks[BIAS_COLS][SB_THREADS + 1];  // (k - μ_K)ᵀ of the CTA's keys, a column chunk (+1: no conflicts)
    __shared__ __align__(16) float ms[SB_BIAS_QBLOCKS][BIAS_COLS];  // μ_Q of the CTA's query blocks, those columns
    const int tid = threadIdx.x, key0 = blockIdx.x * SB_THREADS, key = key0 + tid;
    const int qb0 = blockIdx.y * SB_BIAS_QBLOCKS, h = blockIdx.z % p.Hq;
    const SeqInfo<SmoothQBiasParams> seq(p, blockIdx.z / p.Hq);
    const int hk = seq.kv_head(h), n_qblocks = seq.nq_pad() / SB_BLOCK_Q, len_k = seq.len_k();
    const float* mq = p.q_mean + (seq.q_block0(h) + qb0) * p.D_pad;
    const float* mk = p.k_mean ? p.k_mean + seq.k_slice(hk) * p.D : nullptr;

    float acc[SB_BIAS_QBLOCKS];
#pragma unroll
    for (int j = 0; j < SB_BIAS_QBLOCKS; ++j) acc[j] = 0.f;
    for (int c0 = 0; c0 < p.D; c0 += BIAS_COLS) {
        const int cols = min(BIAS_COLS, p.D - c0);
        // A warp reads 32 columns of one key's row; keys past Lk and columns past D stage zeros (never read into a chain).
        for (int i = tid; i < SB_THREADS * BIAS_COLS; i += SB_THREADS) {
            const int r = i / BIAS_COLS, c = i % BIAS_COLS;
            float x = 0.f;
            if (key0 + r < len_k && c < cols) {
                x = to_f32<SB_BF16>(p.k[seq.key_token(p.sb, p.sh, p.sn, hk, key0 + r) + c0 + c]);
                if (mk) x = x - mk[c0 + c];
            }
            ks[c][r] = x;
        }
        for (int i = tid; i < SB_BIAS_QBLOCKS * BIAS_COLS; i += SB_THREADS) {
            const int j = i / BIAS_COLS, c = i % BIAS_COLS;
            ms[j][c] = qb0 + j < n_qblocks && c < cols ? mq[j * p.D_pad + c0 + c] : 0.f;
        }
        __syncthreads();
        for (int c = 0; c < cols; c += 4) {  // (D, a multiple of 8: whole groups of four columns)
            const float k0 = ks[c][tid], k1 = ks[c + 1][tid], k2 = ks[c + 2][tid], k3 = ks[c + 3][tid];
#pragma unroll
            for (int j = 0; j < SB_BIAS_QBLOCKS; ++j) {
                const float4 m = *reinterpret_cast<const float4*>(&ms[j][c]);  // (a broadcast: one load, four columns)
                acc[j] = fmaf(m.w, k3, fmaf(m.z, k2, fmaf(m.y, k1, fmaf(m.x, k0, acc[j]))));
            }
        }
        __syncthreads();
    }
    if (key >= seq.nk_pad()) return;
#pragma unroll
    for (int j = 0; j < SB_BIAS_QBLOCKS; ++j)
        if (qb0 + j < n_qblocks) p.bias[(seq.q_block0(h) + qb0 + j) * seq.nk_pad() + key] = key < len_k ? acc[j] : 0.f;
}
