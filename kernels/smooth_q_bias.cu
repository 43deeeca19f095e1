// Q-smoothing's exact FP32 add-back: bias[b][h][i][key] = μ_Q(block i) · (k[key] - μ_K), the part of
// each base-2 logit that subtracting the block mean of Q removed.
#include "common.cuh"
#include "convert.cuh"

#ifndef SB_BF16
#define SB_BF16 0
#endif

// grid (ceil(Nk_pad / 128), n_qblocks, B * Hq); one thread per key.
extern "C" __global__ void __launch_bounds__(128)
smooth_q_bias(const u16* __restrict__ k, i64 sb, i64 sh, i64 sn, int Hq, int Hkv, int Lk, int D, int D_pad,
              int Nq_pad, int Nk_pad, const float* __restrict__ q_mean, const float* __restrict__ k_mean,
              float* __restrict__ bias, int bf16) {
    SB_REQUIRE_SM80();
    const int key = blockIdx.x * 128 + threadIdx.x;
    const int qblk = blockIdx.y, bh = blockIdx.z, b = bh / Hq, h = bh % Hq, hk = h / (Hq / Hkv);
    if (key >= Nk_pad) return;
    const int nqb = Nq_pad / SB_BLOCK_Q;
    const float* mq = q_mean + (static_cast<i64>(bh) * nqb + qblk) * D_pad;
    float acc = 0.f;
    if (key < Lk) {
        const u16* kr = k + b * sb + hk * sh + key * sn;
        const float* mk = k_mean ? k_mean + (static_cast<i64>(b) * Hkv + hk) * D : nullptr;
        for (int c = 0; c < D; ++c) {
            const float kv = bf16 ? to_f32<true>(kr[c]) : to_f32<false>(kr[c]);
            acc = fmaf(mq[c], mk ? kv - mk[c] : kv, acc);
        }
    }
    bias[(static_cast<i64>(bh) * nqb + qblk) * Nk_pad + key] = acc;
}
