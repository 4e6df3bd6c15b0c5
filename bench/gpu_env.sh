#!/usr/bin/env bash
# statelm's Python environment on a lent GPU machine (no internet; its python3 already has torch, triton, numpy,
# transformers, pytest, httpx, typer, ...). The wheels it lacks travel in .whl/ (ignored by git; name `.whl` in
# the run's carry). Source it from the repository root so that the exports stay:
#     source bench/gpu_env.sh && python3 -m pytest -q tests/unit
# Fill .whl/ here first (pip reaches the registry here, not there), with the versions bench/gpu_wheels.txt pins:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
#         -d .whl -r bench/gpu_wheels.txt
# It installs .whl/*.whl into /tmp/site, puts /tmp/site and this checkout on PYTHONPATH (statelm is imported
# from the checkout, not installed), and prints the versions. Tests start servers with `python -m statelm`.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then echo "gpu_env.sh: source it: source bench/gpu_env.sh" >&2; exit 1; fi
if [[ ! -f pyproject.toml || ! -d statelm ]] || ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_env.sh: run from the repository root, with .whl/ carried" >&2; return 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_env.sh: installing .whl/*.whl failed" >&2; return 1; }
export PYTHONPATH="/tmp/site:$PWD"
mkdir -p /tmp/site/bin && printf '#!/bin/sh\nexec python3 -m statelm "$@"\n' >/tmp/site/bin/statelm && chmod +x /tmp/site/bin/statelm
export PATH="/tmp/site/bin:$PATH"
# schemathesis and langchain-openai are not carried: leave out the two test modules that import them.
[[ "${PYTEST_ADDOPTS:-}" == *test_schemathesis* ]] ||
    export PYTEST_ADDOPTS="--ignore=tests/http/test_schemathesis.py --ignore=tests/e2e/test_langchain.py ${PYTEST_ADDOPTS:-}"
python3 - <<'EOF'
import importlib.metadata as md, platform, sys
from packaging.requirements import Requirement
for dist in md.distributions(path=["/tmp/site"]):  # warn where the machine's own packages miss a carried floor
    for req in map(Requirement, dist.requires or []):
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(f"gpu_env.sh: warning: {dist.metadata['Name']} wants {req}, found {have}", file=sys.stderr)
import torch, triton
cuda = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, triton {triton.__version__}")
print(f"cuda device: {cuda}")
EOF
