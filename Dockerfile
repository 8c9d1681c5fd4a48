# syntax=docker/dockerfile:1
# Build a wheel of idemproxy and its dependencies, then install them into a clean slim image.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY idemproxy ./idemproxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 idemproxy \
    && useradd --system --uid 10001 --gid idemproxy --home-dir /var/lib/idemproxy --create-home idemproxy
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl \
    && rm -rf /wheels
COPY deploy/docker/config.yaml /etc/idemproxy/config.yaml
WORKDIR /var/lib/idemproxy
USER 10001:10001
EXPOSE 8080 9090
# Straight to the admin port, never through $http_proxy (Docker sets it in containers from the client's proxy
# settings; the proxy would be asked for 127.0.0.1:9090).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:9090/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["idemproxy"]
CMD ["serve", "--config", "/etc/idemproxy/config.yaml"]
