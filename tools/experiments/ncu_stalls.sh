#!/bin/bash
# Experiment helper: ncu's stall reasons (per issued instruction), tensor pipes and shared-memory pipe of one backward
# launch. Arguments: LABEL:IMPL:ENV=VALUE ... (IMPL ours or cudnn); SEQ (2048), CAUSAL ("" or --causal) from the
# environment; one CSV a label in $OUT.
M=$(ncu --query-metrics 2>/dev/null | grep -oE "^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active" | sort -u | sed 's/$/.ratio/' | tr '\n' ',')
T=$(ncu --query-metrics 2>/dev/null | grep -oE "^sm__pipe_tensor[a-z_]*cycles_active" | sort -u | sed 's/$/.avg.pct_of_peak_sustained_active/' | tr '\n' ',')
S="l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed"
X="gpu__time_duration.sum,smsp__inst_executed.sum,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__warps_eligible.avg.per_cycle_active,smsp__warps_active.avg.per_cycle_active"
for spec in "$@"; do
  IFS=: read -r label impl env <<< "$spec"
  kernel='regex:^attention_backward$'; [ "$impl" = cudnn ] && kernel='regex:bprop'
  env $env timeout 200 ncu --csv --metrics "${M}${T}${S},${X}" --kernel-name "$kernel" --launch-skip 2 --launch-count 1 \
    python3 tools/profile_step.py --impl "$impl" --pass bwd --head-dim 128 --seqlen "${SEQ:-2048}" --tokens 16384 \
    --hidden 2048 --gqa 1 --dtype bfloat16 ${CAUSAL} > "$OUT/$label.csv" 2>&1
done
