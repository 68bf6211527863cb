"""A CPU hog for the load pass and the flake hunt: one busy process per core, so that the tests run
as they would on a loaded machine and a race shows itself here rather than on the next machine.

It ends by itself: after --seconds, when the process named by --watch is gone (the CI run or the
flake hunt that started it), or on SIGTERM/SIGINT to it; its workers end within a tenth of a second
of their parent. It never outlives the run that started it.

    python .ci/hog.py --seconds 900 --watch $$ &
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def spin(until: float, parent: int, watch: int | None) -> None:
    """Busy arithmetic until the deadline, or until the parent or the watched process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; a terminal's Ctrl-C goes to it
    x = 0
    while True:
        for _ in range(200_000):  # about 10 ms of work between checks
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        if time.monotonic() > until or os.getppid() != parent or (watch and not alive(watch)):
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hog", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, required=True, help="end after this long, whatever happens")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="busy processes (default: cores)")
    p.add_argument("--watch", type=int, help="end as soon as this process is gone")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.workers < 1:
        p.error("--seconds must be positive and --workers at least 1")

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    until = time.monotonic() + args.seconds
    ctx = mp.get_context("fork")
    workers = [
        ctx.Process(target=spin, args=(until, os.getpid(), args.watch), daemon=True)
        for _ in range(args.workers)
    ]
    for w in workers:
        w.start()
    print(f"hog: {args.workers} busy process(es) for at most {args.seconds:g} s", file=sys.stderr, flush=True)
    try:
        while any(w.is_alive() for w in workers):
            if args.watch and not alive(args.watch):
                break
            time.sleep(0.2)
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        for w in workers:
            w.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
