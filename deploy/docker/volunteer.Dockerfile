# A volunteer. Build from the repository root:
#   docker build -f deploy/docker/volunteer.Dockerfile -t dedloc-volunteer .
# The default installs torch's CPU wheels; for an NVIDIA GPU build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124
# and run with `--gpus all`. Join (the invite is needed on the first join of a data dir only):
#   docker run -d --name volunteer -v dedloc-volunteer:/data -e VOLUNTEER_INVITE=dli1_… dedloc-volunteer my-run@4fT9…
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocols ./protocols
COPY shared ./shared
COPY backbone ./backbone
COPY volunteer ./volunteer
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch>=2.2" \
    && pip install --no-cache-dir ".[volunteer]" && rm -rf /src

RUN useradd --system --create-home --home-dir /data --shell /usr/sbin/nologin dedloc
USER dedloc
WORKDIR /data
VOLUME ["/data"]
# Behind Docker's NAT the volunteer finds itself unreachable and runs in client mode, or reserves a relay
# slot at a backbone: no port needs publishing. Publish one (-p 4002:4002 and --listen below) to aggregate.
STOPSIGNAL SIGTERM
ENTRYPOINT ["volunteer", "join", "--data-dir", "/data", "--no-panel"]
