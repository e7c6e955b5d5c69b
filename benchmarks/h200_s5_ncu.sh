#!/usr/bin/env bash
# Session 5, call 1 (kind nvidia-h200): Nsight Compute on cuBLAS and our TMA kernel at the two
# N = 768 shapes (benchmarks/ncu_probe.py): kernel names, duration, clocks, tensor-pipe and
# shared-memory use, stalls.
source benchmarks/device_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; $NCU --version | tail -1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
t0=$(date +%s)
# The warm-up launches are profiled too; the last two of each are the ones to read.
timeout 400 $NCU --clock-control none --target-processes all \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --metrics sm__cycles_elapsed.avg.per_second \
  --csv --page details -o $LOG/ncu python3 benchmarks/ncu_probe.py > $LOG/ncu_run.log 2>&1
echo "ncu rc $? in $(( $(date +%s) - t0 )) s"; tail -5 $LOG/ncu_run.log
$NCU --import $LOG/ncu.ncu-rep --csv --page details > $OUT/ncu_details.csv 2> $LOG/ncu_import.err
$NCU --import $LOG/ncu.ncu-rep --csv --page raw > $LOG/ncu_raw.csv 2>> $LOG/ncu_import.err
wc -l $OUT/ncu_details.csv; head -3 $LOG/ncu_import.err
gzip -c $LOG/ncu_raw.csv > $OUT/ncu_raw.csv.gz
cp $LOG/ncu.ncu-rep $OUT/ 2>/dev/null
tar czf $OUT/logs-s5-call1.tgz -C /tmp logs --exclude='*.ncu-rep' --exclude='ncu_raw.csv'
