"""A process worker that stops cleanly on SIGTERM/SIGINT.

`prefect worker start` (3.9.1) logs "Received SIGTERM" and keeps running when started without a
terminal, so stopping it took SIGKILL. This runs the same ProcessWorker inside an anyio task group
and turns SIGTERM/SIGINT into a cancellation of that group, which lets the worker tear down.

`worker.py --forget POOL NAME...` (infra/prefect-down.sh, after it stopped those workers): their
records leave the pool and the server recomputes the pool's status. A stopped worker otherwise stays
`Online` in the UI: the server derives a worker's status from its last heartbeat only in its
`foreman` service (a worker is offline 3 heartbeat intervals, 90 s, after its last one), and a
UI-only server over the same database (`make demo-ui`, `--no-services`) never runs it.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

import anyio


def worker_name(name: str) -> str:
    """The name a worker started here as `name` (worker, worker-2, ...) registers in its pool."""
    return f"{name}-{socket.gethostname()}"


async def main(pool: str, name: str | None) -> None:
    from prefect.workers.process import ProcessWorker

    # a distinct name per worker: the pool's page lists each of them
    # DRAFTER_WORKER_LIMIT: flow runs this worker runs at once (a GPU node: its ranges one at a time)
    limit = int(os.environ["DRAFTER_WORKER_LIMIT"]) if os.environ.get("DRAFTER_WORKER_LIMIT") else None
    worker = ProcessWorker(work_pool_name=pool, name=worker_name(name) if name else None, limit=limit)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.start)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            print(f"process worker polling pool {pool!r}", flush=True)
            async for signum in signals:
                print(f"received signal {signum}: stopping the worker", flush=True)
                group.cancel_scope.cancel()
                break
    print("worker stopped", flush=True)


def forget(pool: str, names: list[str]) -> int:
    """Remove the records of stopped workers from `pool`, then let the server recompute the pool's
    status (an update with `is_paused: false` sets it Ready or Not Ready from the workers still
    online; a paused pool is left paused). 0 when done, 1 (one line on stderr) when not."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        with get_client(sync_client=True) as client:
            for name in names:
                try:
                    client.request("DELETE", "/work_pools/{work_pool_name}/workers/{name}",
                                   path_params={"work_pool_name": pool, "name": worker_name(name)})
                except PrefectHTTPStatusError as err:
                    if err.response.status_code != 404:  # 404: never registered, or already gone
                        raise
            if not client.read_work_pool(pool).is_paused:
                client.update_work_pool(pool, WorkPoolUpdate(is_paused=False))
            status = client.read_work_pool(pool).status
    except Exception as err:  # the server is gone or refused: the records stay until its services run
        print(f"could not remove the stopped workers from pool {pool!r}: {type(err).__name__}: {err}",
              file=sys.stderr)
        return 1
    print(f"pool {pool}: removed worker(s) {', '.join(map(worker_name, names))}; pool status "
          f"{status.value if status else 'unknown'}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--forget"]:
        sys.exit(forget(sys.argv[2], sys.argv[3:]))
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "drafter-local", sys.argv[2] if len(sys.argv) > 2 else None)
