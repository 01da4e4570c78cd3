# The tabloop image: one image, the command picks the process (serve, relay, train, up,
# simulate). CPU-only torch; runs as an unprivileged user; data under /data (a volume).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TABLOOP_HOST=0.0.0.0 TABLOOP_DATA_DIR=/data
# torch first, from PyTorch's CPU wheel index: the CPU build (about 200 MB) instead of the
# default CUDA one (several GB); the version is the one pyproject.toml pins
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY service ./service
COPY trainer ./trainer
COPY tabloop ./tabloop
COPY simulator ./simulator
COPY migrations ./migrations
COPY benchmarks ./benchmarks
RUN pip install . \
    && useradd --create-home --uid 10001 tabloop \
    && mkdir -p /data && chown tabloop:tabloop /data
USER tabloop
EXPOSE 8000
CMD ["tabloop", "serve"]
