# The otelkv sidecar as a container, built from this repository (collectors/compose.yaml
# builds it with the repository root as context). Only the package is copied in.
FROM python:3.11.11-slim-bookworm

WORKDIR /src
COPY pyproject.toml README.md ./
COPY otelkv ./otelkv
RUN pip install --no-cache-dir ".[sidecar]" && useradd --system --uid 10001 otelkv

USER otelkv
EXPOSE 8800 8801
ENTRYPOINT ["otelkv"]
CMD ["sidecar", "--help"]
