# Sourced first by the benchmarks/h200*.sh scripts, which run on the GPU machine from the repository
# root with .whl carried (see the device notes): strict variables, unbuffered Python, the output
# folder ($OUT comes back; /tmp/logs is tarred into it), the wheels the GPU image lacks (Jupyter,
# nbval), and this checkout on the import path.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site nbclient ipykernel nbval ipywidgets tqdm > $LOG/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD
