#!/bin/bash
# Experiment helper: ncu_stalls.sh's metrics for one backward launch of narrow_backward.py's variants (ARGS: the
# variants, e.g. twopass pair, or cudnn for SDPA-cuDNN's bprop; SHAPE from the environment, default 1x16x4x8192x192x128),
# one CSV a variant in $OUT, then ncu_stalls_table.py's table.
M=$(ncu --query-metrics 2>/dev/null | grep -oE "^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active" | sort -u | sed 's/$/.ratio/' | tr '\n' ',')
T=$(ncu --query-metrics 2>/dev/null | grep -oE "^sm__pipe_tensor[a-z_]*cycles_active" | sort -u | sed 's/$/.avg.pct_of_peak_sustained_active/' | tr '\n' ',')
S="l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed"
X="gpu__time_duration.sum,smsp__inst_executed.sum,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active,launch__registers_per_thread"
for v in "$@"; do
  kernel='regex:^attention_backward$'; [ "$v" = cudnn ] && kernel='regex:bprop'
  timeout 200 ncu --csv --metrics "${M}${T}${S},${X}" --kernel-name "$kernel" --launch-skip 2 --launch-count 1 \
    python3 tools/experiments/narrow_backward.py one --variant "$v" --shapes "${SHAPE:-1x16x4x8192x192x128}" > "$OUT/$v.csv" 2>&1
done
python3 tools/experiments/ncu_stalls_table.py "$OUT"/*.csv
