// Logit soft-capping (numerics.py: soft-capping), on base-2 scores x: C·tanh(x·(1/C)) with
// C = softcap·log2(e) (params.cuh softcap2, inv_softcap2), in SB_SOFTCAP kernels. The backward's dS
// takes the derivative 1 - tanh², with tanh recovered from the probability it already holds,
// p = exp2(C·tanh - LSE2): tanh = (log2 p + LSE2)/C, so no second value per score is held.
#pragma once
#include "common.cuh"
#include "config.cuh"
#include "exp2.cuh"

SB_DEVICE float soft_cap(float x, float c, float inv_c) { return c * tanh_approx(x * inv_c); }

// 1 - tanh² at the score of probability p under base-2 LSE lse2, tanh clamped to [-1, 1] (where p is 0,
// masked or underflowed, log2 p is -inf: the slope is 0 then, and dS is 0 there either way).
SB_DEVICE float soft_cap_slope(float p, float lse2, float inv_c) {
    const float th = fminf(fmaxf((log2_approx(p) + lse2) * inv_c, -1.f), 1.f);
    return fmaf(-th, th, 1.f);
}
