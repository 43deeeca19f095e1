"""The GPU path: launch plans, the host side of each kernel, the kernel specializations, the NVRTC
compiler and its cache, the kernels' parameter lists, TMA tensor maps and device queries."""
