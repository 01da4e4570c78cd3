# The tabloop image: one image, the command picks the process (serve, relay, train).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TABLOOP_HOST=0.0.0.0
COPY pyproject.toml README.md ./
COPY service ./service
COPY trainer ./trainer
COPY tabloop ./tabloop
COPY migrations ./migrations
# torch==2.13.0 is pinned in pyproject; point pip at PyTorch's CPU wheel index
# (--extra-index-url) for a much smaller CPU-only image.
RUN pip install .
EXPOSE 8000
CMD ["tabloop", "serve"]
