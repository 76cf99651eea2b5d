# The image KubeRay pods run (cluster.launcher.kuberay.code = "image"): Ray 2.60 on Python 3.11 with CUDA, and
# shardline with its dependencies installed. Build and push it where your cluster pulls from:
#   docker build -t REGISTRY/shardline:0.1.0 . && docker push REGISTRY/shardline:0.1.0
# then render with --set cluster.launcher.kuberay.image=REGISTRY/shardline:0.1.0
FROM rayproject/ray:2.60.0-py311-gpu
WORKDIR /app
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users flows ./flows
COPY --chown=ray:users tasks ./tasks
COPY --chown=ray:users training ./training
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users infra ./infra
COPY --chown=ray:users configs ./configs
# torch==2.13.0 from PyPI on Linux is the CUDA build, which is what GPU pods need.
RUN python -m pip install --no-cache-dir . && python -c "import flows.cli, training.loop"
