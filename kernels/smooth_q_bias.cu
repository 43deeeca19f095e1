// Q-smoothing's exact FP32 add-back: bias[b][h][i][key] = μ_Q(block i) · (k[key] - μ_K), the part of
// each base-2 logit that subtracting the block mean of Q removed.
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "convert.cuh"

// grid (ceil(Nk_pad / SB_THREADS), n_qblocks, B * Hq); one thread per key (SB_THREADS: specs.BIAS_THREADS).
extern "C" __global__ void __launch_bounds__(SB_THREADS)
smooth_q_bias(SB_KERNEL_PARAMS(SB_SMOOTH_Q_BIAS_FIELDS)) {
    const SmoothQBiasParams p = SB_KERNEL_VIEW(SmoothQBiasParams, SB_SMOOTH_Q_BIAS_FIELDS);
    SB_REQUIRE_SM80();
    const int key = blockIdx.x * SB_THREADS + threadIdx.x;
    const int qblk = blockIdx.y, h = blockIdx.z % p.Hq;
    const SeqInfo<SmoothQBiasParams> seq(p, blockIdx.z / p.Hq);
    const int hk = seq.kv_head(h);
    if (key >= seq.nk_pad()) return;
    const float* mq = p.q_mean + (seq.q_block0(h) + qblk) * p.D_pad;
    float acc = 0.f;
    if (key < seq.len_k()) {
        const u16* kr = p.k + seq.key_token(p.sb, p.sh, p.sn, hk, key);
        const float* mk = p.k_mean ? p.k_mean + seq.k_slice(hk) * p.D : nullptr;
        for (int c = 0; c < p.D; ++c) {
            const float kv = to_f32<SB_BF16>(kr[c]);
            acc = fmaf(mq[c], mk ? kv - mk[c] : kv, acc);
        }
    }
    p.bias[(seq.q_block0(h) + qblk) * seq.nk_pad() + key] = acc;
}
