# Sourced by the GPU scripts (resnet20_full_gpu.sh, lever_seeds_gpu.sh) as the device tool runs
# them: installs the wheels carried in .whl (packages the device image lacks), finds the data
# (../shared/data, or the .device-data pack unpacked and checked, device_data.py), and sets
# python, out ($OUT, else $1), data and warm_cache (the standard.py option naming the carried
# .warm-cache, public warm starts computed beforehand, when there is one).
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
out=${OUT:-$1}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
data=../shared/data
if [ ! -d "$data/cifar10" ] && [ -d .device-data ]; then
  data=/tmp/gep-fed-data
  "$python" benchmarks/device_data.py unpack .device-data "$data"
fi
# the pack holds only the anchors, not the 10,000 public images a warm start may train on
warm_cache=()
if [ -d .warm-cache ]; then warm_cache=(--warm-cache "$PWD/.warm-cache"); fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
