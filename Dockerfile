# The project's one image: the `outbox` command with the library and both daemons.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md schema.sql ./
COPY outbox ./outbox
COPY dispatcher ./dispatcher
COPY consumer ./consumer
RUN pip install --no-cache-dir . && useradd --system outbox
USER outbox
ENTRYPOINT ["outbox"]
