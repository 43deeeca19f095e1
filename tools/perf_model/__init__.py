"""A performance model of the mma.sync kernels: SASS counts, card figures, per-resource bounds and a
latency factor fitted on one calibration card (docs/PERFORMANCE.md, "Predicted, not measured")."""
