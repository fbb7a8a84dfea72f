# Sourced by the infra scripts: one local Prefect server per checkout, state under .prefect/.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DRAFTER_PROJECT_DIR="$ROOT"
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.prefect}"
export PREFECT_SERVER_API_HOST="${PREFECT_SERVER_API_HOST:-127.0.0.1}"
export PREFECT_SERVER_API_PORT="${PREFECT_SERVER_API_PORT:-4200}"
export PREFECT_API_URL="http://${PREFECT_SERVER_API_HOST}:${PREFECT_SERVER_API_PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_ENABLED="${PREFECT_UI_ENABLED:-true}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
VENV="${VENV:-$ROOT/.venv}"
PREFECT="$VENV/bin/prefect"
RUN_DIR="$PREFECT_HOME/run"
POOL="${DRAFTER_WORK_POOL:-drafter-local}"
mkdir -p "$RUN_DIR"
export PREFECT_LOGGING_EXTRA_LOGGERS="${PREFECT_LOGGING_EXTRA_LOGGERS:-drafter}"  # library warnings (storage retries, reaped servers) in the run log
