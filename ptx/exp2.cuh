// ex2.approx.ftz.f32: 2^x on the special-function unit (2 ulp; exp2(-inf) = 0).
#pragma once
#include "common.cuh"

SB_DEVICE float exp2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// rcp.approx.ftz.f32: 1/x on the special-function unit (1 ulp), one instruction where div.rn is a
// dozen with a slow-path branch.
SB_DEVICE float rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// lg2.approx.ftz.f32
SB_DEVICE float log2_approx(float x) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// tanh.approx.f32 (sm_75+): tanh(x) on the special-function unit (relative error below 2^-10.9).
SB_DEVICE float tanh_approx(float x) {
    float r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
