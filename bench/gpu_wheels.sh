#!/usr/bin/env bash
# The wheels a bare GPU machine without network needs for bench/gpu.sh, into .whl/ (ignored by git).
#
# Such a machine (Python 3.12, its own torch, accelerate, tokenizers, pyarrow, pandas) lacks DeepSpeed and
# datasets and has an older transformers: we bring the versions of requirements.txt, and the packages they need that
# it does not have. About 19 MB; pyarrow (55 MB) is left out, so the machine's own must satisfy datasets' pin.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
mkdir -p .git/info && { grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude; }
pin() { grep -E "^$1==" requirements.txt | cut -d= -f3; }
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python -m pip download -q --no-deps "${target[@]}" -d .whl "transformers==$(pin transformers)" \
    "datasets==$(pin datasets)" dill==0.4.1 multiprocess==0.70.19 hjson==3.1.0 pydantic==2.13.4 \
    pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
# DeepSpeed publishes a source distribution only; built without its C++ ops (they compile on first use there).
python -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(pin deepspeed)"
ls -la .whl
