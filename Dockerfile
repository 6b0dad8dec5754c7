FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY genq ./genq
COPY producer ./producer
COPY worker ./worker
COPY monitor ./monitor
RUN pip install --no-cache-dir .
ENTRYPOINT ["genq"]
