"""Public figures of the cards the model speaks of, in one table.

Sources (vendor publications; dense, non-sparse tensor rates):
  - RTX 4090: NVIDIA Ada GPU Architecture whitepaper (v1.01), appendix table "GeForce RTX 4090": 128 SMs,
    2520 MHz boost, peak INT8 tensor 660.6 TOPS, peak FP16 tensor with FP32 accumulate 165.2 TFLOPS,
    1008 GB/s (21 Gbps GDDR6X, 384-bit), 72 MB L2.
  - RTX 5090: NVIDIA RTX Blackwell GPU Architecture whitepaper, table "GeForce RTX 5090": 170 SMs, 2407 MHz
    boost, peak INT8 tensor 838 TOPS, FP16 tensor with FP32 accumulate 209.5 TFLOPS, 1792 GB/s (28 Gbps
    GDDR7, 512-bit). Check: both rates are the 4090's per SM and clock (1024 INT8 and 256 FP16-FP32
    multiply-adds an SM a clock) at 170 SMs and 2.407 GHz: 2*170*2.407e9*1024 = 838e12, *256 = 209.5e12.
  - H100 SXM5 / H200: NVIDIA H100 Tensor Core GPU datasheet and architecture whitepaper, H200 datasheet:
    132 SMs, 1980 MHz max boost, 3.35 TB/s (H100 HBM3) and 4.8 TB/s (H200 HBM3e). Their published tensor
    rates (1979 INT8 TOPS, 989 FP16 TFLOPS) are wgmma's; the mma.sync instructions reach a fraction of
    them, so on Hopper the model takes the mma.sync rates measured by the calibration run
    (kernels/ceiling.cu), never these.
  - Per-SM pipes and limits: CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table
    (results a clock an SM: FP32 128, 32-bit integer add/compare/logic 64, special functions and
    conversions 16, for compute capability 8.6, 8.9, 9.0 and 12.0) and "Technical Specifications per
    Compute Capability" (65536 registers an SM; 1536 threads an SM on 8.6/8.9/12.0, 2048 on 9.0;
    shared memory a block 99 KB on 8.6/8.9/12.0, 227 KB on 9.0); four warp schedulers an SM each
    issuing one instruction a clock; shared memory 32 banks of 4 bytes (128 bytes a clock an SM).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Card:
    key: str
    name: str
    arch: str  # the SASS the model counts for it
    sms: int
    boost_ghz: float
    dram_gbps: float
    int8_tops: float | None  # dense tensor rate used by the mma.sync kernels (None: measured, Hopper)
    fp16_f32acc_tflops: float | None
    shared_per_block: int  # opt-in bytes a block
    shared_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int
    regs_per_sm: int = 65536
    issue_per_sm: int = 4  # warp instructions a clock (four schedulers)
    fma_lanes: int = 128
    alu_lanes: int = 64
    xu_lanes: int = 16
    lsu_lanes: int = 32  # one warp-wide load/store/shuffle a clock an SM
    shared_bytes_per_clk: int = 128
    note: str = ""

    def macs_per_clk(self, kind: str, measured: dict | None = None) -> float:
        """Tensor multiply-adds a clock an SM for ``kind`` ("i8" or "f16"); on Hopper from ``measured``
        ({"int8_mma_tops", "fp16_mma_tflops", "clock_mhz"}: the calibration run's mma.sync ceilings)."""
        rate = self.int8_tops if kind == "i8" else self.fp16_f32acc_tflops
        clock = self.boost_ghz * 1e9
        if rate is None:
            if not measured:
                raise ValueError(f"{self.name}: mma.sync rates come from a calibration run")
            rate = measured["int8_mma_tops" if kind == "i8" else "fp16_mma_tflops"]
            clock = measured["clock_mhz"] * 1e6
        return rate * 1e12 / (2 * self.sms * clock)


CARDS = {
    "H100": Card("H100", "NVIDIA H100 SXM5 80GB", "sm_90", 132, 1.98, 3350, None, None, 232448, 233472, 2048, 32,
                 note="mma.sync kernels (SAGEBWD_WGMMA=0); tensor rates measured"),
    "H200": Card("H200", "NVIDIA H200 141GB", "sm_90", 132, 1.98, 4800, None, None, 232448, 233472, 2048, 32,
                 note="mma.sync kernels (SAGEBWD_WGMMA=0); tensor rates measured"),
    "RTX4090": Card("RTX4090", "GeForce RTX 4090", "sm_89", 128, 2.52, 1008, 660.6, 165.2, 101376, 102400, 1536, 24),
    "RTX5090": Card("RTX5090", "GeForce RTX 5090", "sm_120", 170, 2.407, 1792, 838.0, 209.5, 101376, 102400, 1536, 32,
                    note="SASS compiled for sm_120 by NVRTC (sm_89's as a cross-check)"),
}
PREDICTED = ("RTX4090", "RTX5090")


def card_for_device(name: str) -> Card:
    """The table's card for a device name as torch reports it (the calibration machine)."""
    upper = name.upper()
    if "H200" in upper:
        return CARDS["H200"]
    if "H100" in upper:
        return CARDS["H100"]
    for card in CARDS.values():
        if card.name.upper().split()[-1] in upper.replace(" ", ""):
            return card
    raise KeyError(f"no card figures for {name!r}")
