# Sourced by scripts/vllm/install.sh and scripts/sglang/install.sh, with CACHE, VENV, VOCAB and LLAMA_PY
# set: the tiny random-weight Qwen2 (make_model.py) in $CACHE/model, made once from the Qwen2 vocab file
# (tokenizer, no weights) of llama-cpp-python's sdist.
if [ ! -f "$VOCAB" ]; then
    "$VENV/bin/pip" download --quiet --no-binary :all: --no-deps -d "$CACHE/src" "llama-cpp-python==$LLAMA_PY"
    tar -xzf "$CACHE/src/llama_cpp_python-$LLAMA_PY.tar.gz" -C "$CACHE/src" \
        "llama_cpp_python-$LLAMA_PY/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
fi
if [ ! -d "$CACHE/model" ]; then
    rm -rf "$CACHE/model.tmp"  # written aside, then renamed: a half-written model is never used
    nice -n 10 "$VENV/bin/python" "$(dirname "${BASH_SOURCE[0]}")/make_model.py" "$VOCAB" "$CACHE/model.tmp"
    mv "$CACHE/model.tmp" "$CACHE/model"
fi
echo "model: $CACHE/model"
