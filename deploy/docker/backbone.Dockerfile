# The backbone: CPU only, no torch (a cheap server). Build from the repository root:
#   docker build -f deploy/docker/backbone.Dockerfile -t dedloc-backbone .
# Run (the data dir holds the identity, the run's authority key, the SQLite ledger and checkpoints):
#   docker run -d --name backbone -p 4001:4001 -p 8443:8443 -v dedloc-backbone:/data dedloc-backbone \
#     --run-id my-run --manifest /data/run.toml --public-url https://bb.example.org:8443
FROM python:3.11-slim

# The project and the backbone's extras only: sqlalchemy, psycopg, starlette, hypercorn, tokenizers.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocols ./protocols
COPY shared ./shared
COPY backbone ./backbone
COPY volunteer ./volunteer
RUN pip install --no-cache-dir ".[backbone]" && rm -rf /src

# Never root: the backbone only needs its data dir and two ports.
RUN useradd --system --create-home --home-dir /data --shell /usr/sbin/nologin dedloc
USER dedloc
WORKDIR /data
VOLUME ["/data"]
# peers (the DHT and averaging) and the HTTPS API (admission, reports, manifest)
EXPOSE 4001/tcp 8443/tcp
# SIGTERM stops it cleanly (exit 0); the ledger and checkpoints are in /data.
STOPSIGNAL SIGTERM
ENTRYPOINT ["backbone", "start", "--data-dir", "/data", "--listen", "/ip4/0.0.0.0/tcp/4001", "--api-listen", "0.0.0.0:8443", "--no-mdns"]
CMD ["--run-id", "my-run"]
