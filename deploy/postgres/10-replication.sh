#!/bin/sh
# Run once by the postgres image when it creates its data directory (mounted at
# /docker-entrypoint-initdb.d): a role that may stream the WAL, and a pg_hba.conf line
# that lets it. Only the optional postgres-standby service (compose profile "standby")
# uses them; without it they are inert.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<SQL
CREATE ROLE replicator WITH REPLICATION LOGIN PASSWORD '${REPLICATION_PASSWORD:-replicator}';
SQL
echo "host replication replicator all scram-sha-256" >>"$PGDATA/pg_hba.conf"
