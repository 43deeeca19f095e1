"""A performance model of the mma.sync kernels: SASS counts, card figures, per-resource bounds and each
warp's latency chain, with two stall latencies a kernel fitted on one calibration card (docs/PERFORMANCE.md, "Predicted, not measured")."""
