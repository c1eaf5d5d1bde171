#!/usr/bin/env bash
# KV Lab's one entry point for learners and instructors. Try: ./check.sh m02   (or ./check.sh --help)
set -euo pipefail
kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${KVLAB_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$kit/.venv/bin/python" ]; then python="$kit/.venv/bin/python"; else python="python3"; fi
fi
# -P: the current folder is not put on the import path (a student's folder may ship its own checks/)
PYTHONPATH="$kit${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -P -m checks "$@"
