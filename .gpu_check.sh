set -x
R=$PWD; export PYTHONPATH=$R
python -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
W=$(mktemp -d); cd $W
for c in ch1-rounding:ch1_rounding ch5-scaler:ch5_scaler lab-nans-hooks:lab_nans_hooks ch6-matmul:ch6_matmul; do
  /usr/bin/time -f "%e s" python -m mpgpt.grade ${c%%:*} $R/tests/grade_solutions/${c##*:}.py --show-output 2>&1 | grep -v "^PASS"; done
sed 's/dtype=tl.float32)  # PLANT: accumulator/dtype=tl.float16)/' $R/tests/grade_solutions/ch6_matmul.py > acc16.py
python -m mpgpt.grade ch6-matmul acc16.py 2>&1 | grep -v "^PASS"
printf 'import subprocess\nsubprocess.run(["true"])\n' > sp.py; cat $R/tests/grade_solutions/ch6_matmul.py >> sp.py
python -m mpgpt.grade ch6-matmul sp.py 2>&1 | tail -2
printf 'import os\nopen(os.path.expanduser("~/x.so"), "w")\n' > so.py; cat $R/tests/grade_solutions/ch6_matmul.py >> so.py
python -m mpgpt.grade ch6-matmul so.py 2>&1 | tail -2
python -m mpgpt.grade ch6-matmul $R/tests/grade_solutions/ch6_matmul.py --memory-limit 4096 2>&1 | tail -2
ls ~/.triton 2>&1 | head -3
