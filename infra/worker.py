"""A process worker that stops cleanly on SIGTERM/SIGINT.

`prefect worker start` (3.9.1) logs "Received SIGTERM" and keeps running when started without a
terminal, so stopping it took SIGKILL. This runs the same ProcessWorker inside an anyio task group
and turns SIGTERM/SIGINT into a cancellation of that group, which lets the worker tear down.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

import anyio
from prefect.workers.process import ProcessWorker


async def main(pool: str, name: str | None) -> None:
    # a distinct name per worker: the pool's page lists each of them
    # DRAFTER_WORKER_LIMIT: flow runs this worker runs at once (a GPU node: its ranges one at a time)
    limit = int(os.environ["DRAFTER_WORKER_LIMIT"]) if os.environ.get("DRAFTER_WORKER_LIMIT") else None
    worker = ProcessWorker(work_pool_name=pool, name=f"{name}-{socket.gethostname()}" if name else None, limit=limit)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.start)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            print(f"process worker polling pool {pool!r}", flush=True)
            async for signum in signals:
                print(f"received signal {signum}: stopping the worker", flush=True)
                group.cancel_scope.cancel()
                break
    print("worker stopped", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "drafter-local", sys.argv[2] if len(sys.argv) > 2 else None)
