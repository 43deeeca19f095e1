#!/usr/bin/env bash
# ncu (GPU machine) of the wide wgmma forward holding O for V's head dim against the 256-column kernel and cuDNN's
# fprop, one launch each (narrow_value_forward.py one): time (ns), issue slots busy, warps active and eligible a
# scheduler, instructions, registers, tensor pipe. SHAPES and VARIANTS (old new cudnn) from the environment; PASS=bwd
# for the backward whose passes split 192 columns (narrow_backward.py one) against the 256-column one and cuDNN's bprop.
M=gpu__time_duration.sum,sm__inst_issued.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__inst_executed.sum,launch__registers_per_thread,launch__grid_size,launch__block_size
T=$(ncu --query-metrics 2>/dev/null | grep -oE '^sm__pipe_tensor\w*cycles_active' | sort -u | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
if [ "${PASS:-fwd}" = bwd ]; then SCRIPT=narrow_backward.py; KERNELS='^attention_backward$|bprop'
else SCRIPT=narrow_value_forward.py; KERNELS='^attention_forward$|fprop'; fi
for shape in ${SHAPES:-2x16x4x4096x192x128 2x16x4x4096x192}; do for v in ${VARIANTS:-old new cudnn}; do
 echo "== $shape $v"; ncu --csv --metrics $M,$T --kernel-name regex:"$KERNELS" --launch-skip 2 --launch-count 1 python3 tools/experiments/$SCRIPT one --variant $v --shapes $shape 2>&1 | grep '^"' | awk -F'","' '{print $(NF-2)" = "$NF}' | tr -d '"' | grep -E 'duration|inst_issued|warps_|inst_executed|pipe_tensor_cycles|registers'
done; done
