#!/usr/bin/env bash
# The GPU check of docs/benchmarks.md, as one script for a lent GPU machine that has PyTorch and transformers but no
# network. Two steps:
#
#   bash bench/gpu_check.sh prepare      # here, with PyPI: what the GPU machine lacks, into .cache/gpu (about 15 MB)
#   bash bench/gpu_check.sh run OUT      # there, with .cache/gpu carried beside the checkout: results under OUT
#
# `run` takes about 6-8 minutes on an H200 (each case loads its model in a fresh process) and writes, under OUT:
#   gpu.txt                 the GPU, its memory and driver
#   exact.json/.log         packed rows against each sample alone on the device (FlexAttention's block masks with
#                           sliding windows: mistral, gemma3_text, gpt_oss; float32)
#   qwen3.json/.log         Qwen3-1.7B's shape, a group of 8: full and LoRA packed, full padded; tokens/s, MFU, peak
#                           memory, and a profile of one step each (device time by kind of work)
#   moe.json/.log           Qwen3-30B-A3B's layer shapes (4 layers): full fine-tuning, packed and padded, profiled
# Each case has its own time limit, and a case that fails is said and the others still run.
set -u
cd "$(dirname "$0")/.."
GPU=.cache/gpu

if [ "${1:-}" = prepare ]; then
    set -e
    mkdir -p "$GPU"
    .venv/bin/python -c "from tasks import fixtures; print(fixtures.path('qwen3_tokenizer'))" | xargs -I{} cp -r {} "$GPU/"
    .venv/bin/python -m pip install -q --no-deps --target "$GPU/site" pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
    du -sh "$GPU"
    exit 0
fi
if [ "${1:-}" != run ] || [ -z "${2:-}" ]; then
    echo "usage: bash bench/gpu_check.sh prepare | run OUT" >&2
    exit 2
fi
OUT=$2
mkdir -p "$OUT"
export PYTHONPATH="$PWD/$GPU/site:${PYTHONPATH:-}"  # pytest: the exact case imports the tests' helpers
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
case_run() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python bench/gpu_step.py --tokenizer "$GPU/qwen3_tokenizer" --out "$OUT/$name.json" "$@" \
        >"$OUT/$name.log" 2>&1
    echo "[gpu_check] $name: exit $? ($(date +%T))"
}
case_run exact 120 --cases exact
case_run qwen3 240 --group 8 --cases full full,padded lora --profile
case_run moe 180 --family qwen3_moe --group 8 --cases full full,padded --profile
