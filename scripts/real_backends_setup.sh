#!/usr/bin/env bash
# Set up (and start) the two REAL servers that scripts/check_real_backends.py drives, on loopback,
# CPU only, with no model files: a ComfyUI 0.19.3 with a weight-free progress-reporting test node,
# and llama.cpp's llama-server built from the copy inside the llama-cpp-python sdist, serving a
# tiny random-weight GGUF. Idempotent: every step is skipped when its result is already there, and
# every step says what it did. Nothing here lands in the repo: all of it lives under $REAL_DIR.
#
#   COMFY_GIT=/path/to/a/ComfyUI/git-dir scripts/real_backends_setup.sh      # both servers
#   scripts/real_backends_setup.sh comfy | llama                            # one of them
#
# Knobs (environment):
#   REAL_DIR      where everything goes    (default ${XDG_CACHE_HOME:-$HOME/.cache}/kiloline-real)
#   COMFY_GIT     a git directory (a clone, bare or not) holding ComfyUI's history; needed only
#                 while $REAL_DIR/comfyui does not exist yet
#   COMFY_COMMIT  the commit to export                        (default 30860264 = "ComfyUI v0.19.3")
#   TORCH_SPEC    what pip installs for torch                  (default "torch==2.14.1 torchvision==0.29.1")
#   COMFY_PORT / LLAMA_PORT                                    (default 8188 / 8080)
#   LLAMA_KEY     llama-server's --api-key                     (default kl-node-key)
#   LLAMA_CPP_PY  the llama-cpp-python sdist version           (default: the newest)
#   JOBS          cmake --build -j                             (default 1: the build runs niced)
set -euo pipefail

REAL_DIR=${REAL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kiloline-real}
COMFY_COMMIT=${COMFY_COMMIT:-30860264}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}
COMFY_PORT=${COMFY_PORT:-8188}
LLAMA_PORT=${LLAMA_PORT:-8080}
LLAMA_KEY=${LLAMA_KEY:-kl-node-key}
JOBS=${JOBS:-1}
PY=${PYTHON:-python3}
what=${1:-all}

say() { printf '== %s\n' "$*"; }
listening() { curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$1$2"; }

mkdir -p "$REAL_DIR"

setup_comfy() {
    local dir="$REAL_DIR/comfyui" venv="$REAL_DIR/comfy-venv"
    if [ -f "$dir/main.py" ]; then
        say "ComfyUI source: $dir already there ($(grep -o '"[0-9.]*"' "$dir/comfyui_version.py"))"
    else
        [ -n "${COMFY_GIT:-}" ] || { echo "set COMFY_GIT to a git directory holding ComfyUI's history" >&2; exit 2; }
        say "ComfyUI source: exporting $COMFY_COMMIT from $COMFY_GIT into $dir"
        mkdir -p "$dir"
        # cat-file rather than git archive: a partial mirror may lack a few large blobs (tokenizer
        # vocabularies of text encoders) that a weight-free workflow never reads.
        git --git-dir="$COMFY_GIT" ls-tree -r "$COMFY_COMMIT" | awk '$2=="blob"{print $3"\t"$4}' |
            (cd "$dir" && "$PY" -c '
import os, subprocess, sys
gd = sys.argv[1]
cat = subprocess.Popen(["git", "--git-dir", gd, "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
missing = []
for line in sys.stdin:
    sha, path = line.rstrip("\n").split("\t", 1)
    cat.stdin.write((sha + "\n").encode()); cat.stdin.flush()
    head = cat.stdout.readline().split()
    if head[-1] == b"missing":
        missing.append(path); continue
    data = cat.stdout.read(int(head[2])); cat.stdout.read(1)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
print("   blobs missing from that git directory (skipped):", missing or "none")
' "$COMFY_GIT")
    fi
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import torch, aiohttp, safetensors' 2>/dev/null; then
        say "ComfyUI venv: $venv already has torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
    else
        say "ComfyUI venv: $venv with $TORCH_SPEC, then ComfyUI's requirements without torch/torchvision/torchaudio"
        "$PY" -m venv "$venv"
        # shellcheck disable=SC2086
        "$venv/bin/pip" install -q $TORCH_SPEC
        grep -vE '^(torch|torchvision|torchaudio)$' "$dir/requirements.txt" > "$REAL_DIR/comfy-reqs-notorch.txt"
        "$venv/bin/pip" install -q -r "$REAL_DIR/comfy-reqs-notorch.txt"
        say "   torchaudio left out: ComfyUI then reports nodes_audio*.py as IMPORT FAILED (not used here)"
    fi
    local node="$dir/custom_nodes/kl_test_nodes/__init__.py"
    say "test node: writing $node (KLSlowProgress, KLFail)"
    mkdir -p "$(dirname "$node")"
    cat > "$node" <<'EOF'
"""Weight-free test nodes for the KiloLine real-backend check (not part of ComfyUI)."""
import time

import torch

import comfy.utils


class KLSlowProgress:
    """Sleeps step_ms per step, reporting each step through comfy.utils.ProgressBar; outputs a blank IMAGE."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "steps": ("INT", {"default": 5, "min": 1, "max": 10000}),
                "step_ms": ("INT", {"default": 100, "min": 0, "max": 600000}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**62}),
            },
            "optional": {"image": ("IMAGE",)},
        }

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"
    CATEGORY = "kiloline"

    def run(self, steps, step_ms, seed, image=None):
        pbar = comfy.utils.ProgressBar(steps)
        for _ in range(steps):
            time.sleep(step_ms / 1000.0)
            pbar.update(1)
        if image is not None:
            return (image,)
        return (torch.zeros((1, 8, 8, 3), dtype=torch.float32),)


class KLFail:
    """Always raises, so the check can see what a failed prompt's result carries."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**62})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"
    CATEGORY = "kiloline"

    def run(self, seed):
        raise RuntimeError(f"kl test failure seed={seed}")


NODE_CLASS_MAPPINGS = {"KLSlowProgress": KLSlowProgress, "KLFail": KLFail}
EOF
    if listening "$COMFY_PORT" /system_stats; then
        say "ComfyUI: already answering on 127.0.0.1:$COMFY_PORT (pid file $REAL_DIR/comfyui.pid)"
    else
        say "ComfyUI: starting on 127.0.0.1:$COMFY_PORT (--cpu), log $REAL_DIR/comfyui.log"
        (cd "$dir" && nohup "$venv/bin/python" main.py --cpu --listen 127.0.0.1 --port "$COMFY_PORT" \
            > "$REAL_DIR/comfyui.log" 2>&1 & echo $! > "$REAL_DIR/comfyui.pid")
        for _ in $(seq 180); do listening "$COMFY_PORT" /system_stats && break; sleep 1; done
        listening "$COMFY_PORT" /system_stats || { echo "ComfyUI did not come up: see $REAL_DIR/comfyui.log" >&2; exit 1; }
        say "ComfyUI: up, pid $(cat "$REAL_DIR/comfyui.pid")"
    fi
}

setup_llama() {
    local dir="$REAL_DIR/llama" tools="$REAL_DIR/tools-venv"
    mkdir -p "$dir"
    local sdist
    sdist=$(ls "$dir"/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
    if [ -z "$sdist" ]; then
        say "llama-cpp-python sdist: pip download into $dir"
        "$PY" -m pip download -q --no-binary :all: --no-deps -d "$dir" "llama-cpp-python${LLAMA_CPP_PY:+==$LLAMA_CPP_PY}"
        sdist=$(ls "$dir"/llama_cpp_python-*.tar.gz | sort -V | tail -1)
    else
        say "llama-cpp-python sdist: $sdist already there"
    fi
    local src="${sdist%.tar.gz}"
    [ -d "$src" ] || { say "unpacking $sdist"; tar xzf "$sdist" -C "$dir"; }
    local cpp="$src/vendor/llama.cpp" bin="$src/vendor/llama.cpp/build/bin/llama-server"
    if [ -x "$bin" ]; then
        say "llama-server: $bin already built"
    else
        say "llama-server: cmake (LLAMA_CURL=OFF) and build the llama-server target only, niced, -j$JOBS"
        nice -n 19 cmake -S "$cpp" -B "$cpp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$dir/cmake-config.log"
        nice -n 19 cmake --build "$cpp/build" --target llama-server -j"$JOBS" > "$dir/build.log"
    fi
    if [ -x "$tools/bin/python" ] && "$tools/bin/python" -c 'import gguf, numpy' 2>/dev/null; then
        say "gguf venv: $tools already there"
    else
        say "gguf venv: $tools with gguf and numpy from PyPI"
        "$PY" -m venv "$tools"
        "$tools/bin/pip" install -q gguf numpy
    fi
    if [ -f "$dir/tiny.gguf" ]; then
        say "model: $dir/tiny.gguf already there"
    else
        say "model: writing $dir/tiny.gguf (random weights, llama.cpp's 32k llama SPM vocabulary)"
        "$tools/bin/python" - "$cpp/models/ggml-vocab-llama-spm.gguf" "$dir/tiny.gguf" <<'EOF'
"""A tiny random-weight llama GGUF that carries a real 32k llama vocabulary, read from a vocab-only GGUF."""
import sys

import gguf
import numpy as np

src = gguf.GGUFReader(sys.argv[1])


def field(name):
    return src.fields[name].contents()


tokens = field("tokenizer.ggml.tokens")
n_vocab, dim, n_head, n_layer, ff = len(tokens), 64, 4, 2, 128
rng = np.random.default_rng(0)


def rnd(*shape):
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


w = gguf.GGUFWriter(sys.argv[2], arch="llama")
w.add_name("kiloline-tiny-random")
w.add_block_count(n_layer)
w.add_context_length(2048)
w.add_embedding_length(dim)
w.add_feed_forward_length(ff)
w.add_head_count(n_head)
w.add_head_count_kv(n_head)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_dimension_count(dim // n_head)
w.add_vocab_size(n_vocab)
w.add_file_type(0)
w.add_tokenizer_model("llama")
w.add_tokenizer_pre("default")
w.add_token_list(tokens)
w.add_token_scores(field("tokenizer.ggml.scores"))
w.add_token_types(field("tokenizer.ggml.token_type"))
w.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))
w.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))
w.add_unk_token_id(int(field("tokenizer.ggml.unknown_token_id")))
w.add_add_bos_token(True)
w.add_add_eos_token(False)
w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
w.add_tensor("token_embd.weight", rnd(n_vocab, dim))
w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
w.add_tensor("output.weight", rnd(n_vocab, dim))
for i in range(n_layer):
    p = f"blk.{i}."
    w.add_tensor(p + "attn_norm.weight", np.ones(dim, dtype=np.float32))
    for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(p + t + ".weight", rnd(dim, dim))
    w.add_tensor(p + "ffn_norm.weight", np.ones(dim, dtype=np.float32))
    w.add_tensor(p + "ffn_gate.weight", rnd(ff, dim))
    w.add_tensor(p + "ffn_up.weight", rnd(ff, dim))
    w.add_tensor(p + "ffn_down.weight", rnd(dim, ff))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"   llama, {n_layer} layers, dim {dim}, vocab {n_vocab}")
EOF
    fi
    if listening "$LLAMA_PORT" /health; then
        say "llama-server: already answering on 127.0.0.1:$LLAMA_PORT (pid file $REAL_DIR/llama-server.pid)"
    else
        say "llama-server: starting on 127.0.0.1:$LLAMA_PORT --parallel 4 -c 2048 --api-key $LLAMA_KEY, log $REAL_DIR/llama-server.log"
        # --alias: without it the model id is the file's path, slashes and all.
        nohup "$bin" -m "$dir/tiny.gguf" --alias kiloline-tiny --host 127.0.0.1 --port "$LLAMA_PORT" \
            --parallel 4 -c 2048 --api-key "$LLAMA_KEY" > "$REAL_DIR/llama-server.log" 2>&1 &
        echo $! > "$REAL_DIR/llama-server.pid"
        for _ in $(seq 60); do listening "$LLAMA_PORT" /health && break; sleep 1; done
        listening "$LLAMA_PORT" /health || { echo "llama-server did not come up: see $REAL_DIR/llama-server.log" >&2; exit 1; }
        say "llama-server: up, pid $(cat "$REAL_DIR/llama-server.pid")"
    fi
}

case "$what" in
    all) setup_comfy; setup_llama ;;
    comfy) setup_comfy ;;
    llama) setup_llama ;;
    *) echo "usage: $0 [all|comfy|llama]" >&2; exit 2 ;;
esac
say "done. Check: .venv/bin/python scripts/check_real_backends.py --comfy-url http://127.0.0.1:$COMFY_PORT" \
    "--llama-url http://127.0.0.1:$LLAMA_PORT --llama-key $LLAMA_KEY --comfy-dir $REAL_DIR/comfyui" \
    "--comfy-python $REAL_DIR/comfy-venv/bin/python"
