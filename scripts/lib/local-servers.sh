# Sourced by the scripts in scripts/ that run against a NATS and a Redis: where
# MESHSERVE_NATS_URL / MESHSERVE_REDIS_URL are unset and a server answers on its standard
# local port, that server is used (exported); otherwise they stay unset (embedded servers).
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if [[ -z "${MESHSERVE_NATS_URL:-}" ]] && answers 4222; then
  export MESHSERVE_NATS_URL="nats://127.0.0.1:4222"
fi
if [[ -z "${MESHSERVE_REDIS_URL:-}" ]] && answers 6379; then
  export MESHSERVE_REDIS_URL="redis://127.0.0.1:6379/0"
fi
