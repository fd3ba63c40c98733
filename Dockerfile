# One image for every ResiHP service; the compose file picks the module to run.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
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
RUN useradd --create-home resihp
USER resihp
CMD ["resihp", "--help"]
