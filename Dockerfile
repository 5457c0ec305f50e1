# jetloop's processes in a container: workers, the gateway, the projector, `jetloop
# credentials` and `jetloop topology` (compose.yaml builds it; `docker build -t jetloop .`).
# Slim, non-root, `jetloop` as the entrypoint; the dependencies in a layer of their own, so a
# change of the code rebuilds only the last layers and a restart needs no package index.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/jetloop

# 1. The dependencies, from pyproject.toml alone (a placeholder package stands in for the
#    code, and is removed again): cached until pyproject.toml changes.
COPY pyproject.toml README.md ./
RUN mkdir jetloop && touch jetloop/__init__.py \
    && pip install . \
    && pip uninstall -y jetloop \
    && rm -rf jetloop build

# 2. The code.
COPY jetloop ./jetloop
RUN pip install --no-deps . && rm -rf build

# Not root: a process that runs the user's tools gets no more than it needs. /data holds
# the read model and the demo vendor's database; /srv/app is where a user's app is mounted
# (the working directory, so `--app mymodule:app` finds it, as `jetloop worker` does).
RUN useradd --create-home --uid 10001 jetloop \
    && mkdir -p /data /srv/app \
    && chown jetloop:jetloop /data /srv/app
USER jetloop
WORKDIR /srv/app

ENTRYPOINT ["jetloop"]
CMD ["--help"]
