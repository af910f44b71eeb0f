"""A real sidecar in a process of its own, steered over stdin: the fault tests' handle.

Why not the sidecar in the test process: chDB allows one store directory per process, the
tests kill the sidecar's processes with SIGKILL, and their RSS must be the sidecar's alone.
Why not only ``otelkv sidecar``: some faults (a closed store, inserts that raise) and the
"acknowledged" point of a write (``flush`` returned) need the objects inside.

Prints one JSON line with its addresses and pids once serving, then answers each command
line on stdin with one JSON line:

- ``flush``: ``Sidecar.flush`` (proxy turns handed over, writer drained): whether it all
  got written (``flushed``), then ``stats``;
- ``stats``: the writer's counters;
- ``close-store``: close the store under the running writer;
- ``fail-inserts`` / ``heal-inserts``: make every insert raise ``OSError(ENOSPC)``, or not;
- ``stop``: a clean stop (answers, then exits 0).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import sys
from pathlib import Path
from typing import Any

from otelkv.sidecar.app import Sidecar, SidecarConfig


def _failing_insert(encoded: Any) -> int:
    raise OSError(errno.ENOSPC, "injected: no space left on device")


def _stats(sidecar: Sidecar) -> dict[str, Any]:
    return sidecar.writer.stats() if sidecar.writer is not None else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.unit.sidecar_runner")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--store", default=None, help="store directory (none: --no-store)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--admin-host", default="127.0.0.1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    config = SidecarConfig(
        upstream=args.upstream,
        host=args.host,
        port=0,
        admin_host=args.admin_host,
        admin_port=0,
        store=args.store is not None,
        store_path=Path(args.store) if args.store else None,
    )
    sidecar = Sidecar(config).start()
    real_insert = sidecar.store.insert_encoded if sidecar.store is not None else None
    print(
        json.dumps({"proxy": sidecar.url, "admin": sidecar.admin_url, "proxy_pid": sidecar.proxy.pid}),
        flush=True,
    )
    try:
        for line in sys.stdin:
            command = line.strip()
            reply: dict[str, Any] = {"command": command}
            if command == "flush":
                reply["flushed"] = sidecar.flush(timeout=30.0)
            elif command == "close-store":
                sidecar.store.close()
            elif command == "fail-inserts":
                sidecar.store.insert_encoded = _failing_insert
            elif command == "heal-inserts":
                sidecar.store.insert_encoded = real_insert
            elif command == "stop":
                break
            elif command != "stats":
                reply["error"] = f"unknown command {command!r}"
            reply["stats"] = _stats(sidecar)
            print(json.dumps(reply), flush=True)
    finally:
        sidecar.stop()
    with contextlib.suppress(OSError):  # the test may have gone already
        print(json.dumps({"command": "stop", "stopped": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
