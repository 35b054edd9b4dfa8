# nanomolt on GPUs with SGLang as the inference server.
# The trainer (requirements.txt: torch 2.13.0, transformers 5.23.0) and SGLang 0.5.23 (which pins torch 2.14.1,
# transformers 5.19.0) need different builds, so each has its own virtual environment; the trainer starts
# SGLang with --server_python=/opt/sglang/bin/python. Both torch builds are CUDA 13 wheels from PyPI.
#   docker build -t nanomolt .
#   docker run --gpus all --ipc=host -v /models:/models -v $PWD/out:/nanomolt/out nanomolt \
#     torchrun --standalone --nproc_per_node=7 train.py --config configs/qwen3_0p6b_gpu.py \
#       --engine=sglang --server_python=/opt/sglang/bin/python --server_args="--base-gpu-id 7 --dtype bfloat16" \
#       --weight_sync=nccl
# New weights reach SGLang in memory (--weight_sync=nccl: a broadcast from the trainer host's rollout process);
# --weight_sync=disk for servers that cannot join that group. The SGLang tests, GPU variants included:
#   docker run --gpus all --ipc=host nanomolt python -m pytest -q tests/test_servers.py -k sglang
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*

# the inference server, in its own environment
RUN python3 -m venv /opt/sglang && /opt/sglang/bin/pip install --upgrade pip \
    && /opt/sglang/bin/pip install sglang==0.5.23 torch==2.14.1 transformers==5.19.0

# the trainer
WORKDIR /nanomolt
COPY requirements.txt .
RUN python3 -m venv /opt/nanomolt && /opt/nanomolt/bin/pip install --upgrade pip \
    && /opt/nanomolt/bin/pip install -r requirements.txt
ENV PATH=/opt/nanomolt/bin:$PATH NANOMOLT_SGLANG_PYTHON=/opt/sglang/bin/python
COPY . .

CMD ["python", "train.py", "--help"]
