"""A test-only child that lies: it sends back, on the real result pipe, one hostile result chosen by the test
(job["lie"]). Run by tests/confine/test_lying_child.py through `confine.run(job, entry=<this file>)`; it stands for
a child taken over by a kernel exploit, so it is not confined. Not part of the package."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

MiB = 1 << 20


def main(job: dict) -> None:
    fd, lie = job["result_fd"], job["lie"]
    if lie == "endless line":  # no newline, ever: past the per-message bound
        block = b"x" * MiB
        try:
            for _ in range(job["mib"]):
                os.write(fd, block)
        except BrokenPipeError:
            pass
        return
    if lie == "grandchild holds the pipe":  # a process of its own keeps the write end open and sleeps
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        os.write(fd, (json.dumps({"analysis": job["doc"]}) + "\n").encode())
        return
    if lie == "forged crash":  # a sentence of its own as the op name on the progress page, then a crash
        from nanreplay.confine import progress

        progress.attach(job["progress_fd"])
        progress.at(progress.REPLAY, 3, job["op"], 10)
        os.kill(os.getpid(), signal.SIGSEGV)
    if lie == "silent":
        time.sleep(600)
        return
    with open(job["payload_file"], "rb") as f:
        os.write(fd, f.read())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
