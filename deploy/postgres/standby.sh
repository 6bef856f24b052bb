#!/bin/sh
# The postgres-standby service's entry point: on first start, copy the primary with
# pg_basebackup -R (which writes primary_conninfo and standby.signal, so the server
# starts as a streaming standby), then run the image's own entry point, which finds the
# data directory made and starts the server.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  until pg_basebackup -h postgres -U replicator -D "$PGDATA" -R -X stream; do
    echo "standby: the primary is not ready for a base backup yet; retrying" >&2
    sleep 2
  done
  chmod 0700 "$PGDATA"
fi
exec docker-entrypoint.sh postgres
