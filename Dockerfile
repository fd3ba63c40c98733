# One image for every ResiHP service; the compose file picks the module to run.
FROM python:3.11-slim
WORKDIR /app
# RESIHP_CACHE_DIR: where the DAG engine's compiled kernel lives (resihp/pipeline/_kernel.py);
# baked below, read-only for the resihp user, so no container compiles or falls back to numpy.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 RESIHP_CACHE_DIR=/opt/resihp/cache
# A C compiler for that kernel (without one the engine uses its ~10x slower numpy path).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# CPU build of torch, pinned exactly (a default index would pull a multi-GB CUDA build).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY resihp ./resihp
COPY collector ./collector
COPY detector ./detector
COPY scheduler ./scheduler
COPY dashboard ./dashboard
COPY trainer ./trainer
RUN pip install .
# Compile the kernel now: the build fails here rather than every service running on numpy.
RUN CC=gcc python -c "from resihp.pipeline import _kernel; assert _kernel.available(), 'DAG kernel did not compile'" \
    && ls "$RESIHP_CACHE_DIR"/lp_*.so
RUN useradd --create-home resihp
USER resihp
CMD ["resihp", "--help"]
