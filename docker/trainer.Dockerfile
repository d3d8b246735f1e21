# syntax=docker/dockerfile:1
#
# The trainer image: the common runtime image (docker/bcstack.Dockerfile: the `bcstack` package,
# the trainer included) with the CUDA build of the same torch version in place of the CPU one, run
# under torchrun: `bcstack train grpo` with Megatron-style tensor parallelism over one process per
# GPU (NCCL), or over CPU processes (gloo) where there is no GPU; trainer/parallel.py picks the
# backend from what it finds. The CUDA libraries, NCCL among them, come as torch's own wheels, so
# the base needs no CUDA toolkit; the node needs an NVIDIA driver for the CUDA version below.
#
#   docker build -f docker/bcstack.Dockerfile --build-arg BCSTACK_EXTRA=trainer \
#     --build-arg WITH_TORCH=true -t ghcr.io/browsecomp-stack/bcstack:0.1.0-trainer .
#   docker build -f docker/trainer.Dockerfile -t ghcr.io/browsecomp-stack/bcstack-trainer:0.1.0 .
#   docker run --rm --gpus all --shm-size 16g -v "$PWD/checkpoints:/checkpoints" -v "$PWD/records:/data/records" \
#     ghcr.io/browsecomp-stack/bcstack-trainer:0.1.0 \
#     --standalone --nnodes 1 --nproc_per_node 2 -m bcstack train grpo \
#     --records /data/records/coordinator-records.sqlite --model /checkpoints/qwen3-4b-worker-sft \
#     --ref /checkpoints/qwen3-4b-worker-sft --out /checkpoints/qwen3-4b-worker-grpo --resume
#
# The other trainer commands run the same way with one process, or with `--entrypoint bcstack`
# (`bcstack train export ...`, `bcstack checkpoint verify DIR`). Under Kubernetes the chart runs it
# as a Job and sets command and args itself (charts/bcstack/templates/trainer-job.yaml).
#
# probe: none. The trainer is a batch Job, not a service: it serves no port, and Kubernetes judges
# it by its exit status (torchrun exits non-zero when any rank fails), not by a probe.

# The common image of the same release with the [trainer] extra (docker/bcstack.Dockerfile
# --build-arg BCSTACK_EXTRA=trainer --build-arg WITH_TORCH=true), pinned by version (a digest pins it harder:
# --build-arg BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack@sha256:...).
ARG BCSTACK_IMAGE=ghcr.io/browsecomp-stack/bcstack:0.1.0-trainer

FROM ${BCSTACK_IMAGE}

# The CUDA wheel index of torch: CUDA 12.8 runs on NVIDIA drivers from 570 on. Another CUDA
# (e.g. https://download.pytorch.org/whl/cu130 for CUDA 13 drivers) is one --build-arg away.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG BCSTACK_VERSION=0.1.0
LABEL org.opencontainers.image.title="bcstack-trainer" \
      org.opencontainers.image.description="browsecomp-stack trainer (GRPO/SFT under torchrun, CUDA torch)" \
      org.opencontainers.image.version="${BCSTACK_VERSION}"

# The venv is root's (copied from the common image's build stage); swap torch as root, then drop
# back. Same version as the common image (constraints.txt pins torch==2.13.0, which the +cuXXX
# build satisfies): only the build changes. Uninstall first, or pip would keep the installed CPU
# build as already satisfying the pin. No pip cache: HOME is the runtime user's.
COPY constraints.txt /tmp/constraints.txt
USER 0:0
RUN export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    && pip uninstall --yes torch \
    && pip install -c /tmp/constraints.txt --index-url "${TORCH_INDEX_URL}" torch \
    && pip check \
    && python -c "import torch; assert torch.version.cuda, torch.__version__; print(torch.__version__)" \
    && rm /tmp/constraints.txt
USER 10001:10001

ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nnodes", "1", "--nproc_per_node", "1", "-m", "bcstack", "train", "--help"]
