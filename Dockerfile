# The kit's dev container, for linux/amd64 and linux/arm64 (Apple silicon builds arm64 natively): Debian 12 with
# Python 3.11, make and git, then the kit's one set-up script, `make setup` (kit/setup/bootstrap.py): the same script that
# `make test-clean-machine` runs on a clean Debian root. Inside, the README's commands work unchanged.
#
#   docker build -t llmsys .
#   docker run -it --rm --shm-size=2g -v "$PWD:/workspaces/llmsys" -v llmsys-venv:/workspaces/llmsys/.venv llmsys
#
# The first -v keeps your edits on your disk; the second keeps the image's .venv, which the bind mount of the folder
# would hide (Docker fills a new named volume from the image; `docker volume rm llmsys-venv` after a rebuild).
# --shm-size: the distributed stages share tensors through /dev/shm, 64 MiB by default in Docker.
# VS Code and Codespaces: .devcontainer/devcontainer.json builds this file and mounts the same way.
# Both architectures in one image: docker buildx build --platform linux/amd64,linux/arm64 -t llmsys .
FROM python:3.11-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends make git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# PyPI's Linux torch 2.13.0 is the CUDA build, which needs another triton than the kit's pin; the CPU build is on
# PyTorch's CPU index. kit/setup/bootstrap.py retries with that index by itself when the first resolve fails: naming it up
# front only saves the failed resolve (--build-arg TORCH_INDEX= leaves it to the retry).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

WORKDIR /workspaces/llmsys
COPY . .
RUN PIP_EXTRA_INDEX_URL="$TORCH_INDEX" PIP_NO_CACHE_DIR=1 make setup

CMD ["bash"]
