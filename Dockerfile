# ResiHP images, two build targets of one file (the compose file picks the module to run):
#   services  collector, detector, scheduler, dashboard: every dependency but torch
#   trainer   services + the pinned CPU torch wheel (only the trainer imports torch)
FROM python:3.11-slim AS services
WORKDIR /app
# RESIHP_CACHE_DIR: where the DAG engine's compiled kernel lives (resihp/pipeline/_kernel.py);
# baked below, read-only for the resihp user, so no container compiles or falls back to numpy.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 RESIHP_CACHE_DIR=/opt/resihp/cache
# A C compiler for that kernel (without one the engine uses its ~10x slower numpy path).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
# pyproject's dependencies without torch (the services never import it), then the
# project itself without resolving dependencies again (which would pull torch back in)
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; open('/tmp/requirements.txt', 'w').write('\n'.join(d for d in deps if not d.startswith('torch')))" \
    && pip install -r /tmp/requirements.txt
COPY resihp ./resihp
COPY collector ./collector
COPY detector ./detector
COPY scheduler ./scheduler
COPY dashboard ./dashboard
COPY trainer ./trainer
RUN pip install --no-deps .
# Compile the kernel now: the build fails here rather than every service running on numpy.
RUN CC=gcc python -c "from resihp.pipeline import _kernel; assert _kernel.available(), 'DAG kernel did not compile'" \
    && ls "$RESIHP_CACHE_DIR"/lp_*.so
RUN useradd --create-home resihp
USER resihp
CMD ["resihp", "--help"]

FROM services AS trainer
USER root
# CPU build of torch, pinned exactly (a default index would pull a multi-GB CUDA build).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && python -c "import torch, trainer.torch_trainer"
USER resihp
