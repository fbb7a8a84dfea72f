"""Exit 0 when a flow run completed; otherwise print its final state and message (a failed
stage's one-line reason and where to look, written by flows/lifecycle.py) and exit 1.
`prefect deployment run --watch` (3.9) ends with only the state's name, so the demo scripts
print this after it."""
from __future__ import annotations

import sys

from prefect.client.orchestration import get_client


def main(flow_run_id: str) -> int:
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    if state is not None and state.is_completed():
        return 0
    print("== the run failed")
    print(f"{state.name}: {state.message}" if state is not None else "the run has no state")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
