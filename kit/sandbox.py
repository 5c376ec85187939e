"""Launch a command under resource limits: ``python -m kit.sandbox --memory-gb 8 -- CMD …``.

The grader starts every graded run through this launcher instead of ``preexec_fn`` (which is unsafe when
the grader runs several submissions from threads). Limits apply to the command and everything it starts:

* address space (``RLIMIT_AS``) per process — skipped when CUDA is present, since the CUDA driver
  reserves far more virtual memory than it uses;
* size of any file written (``RLIMIT_FSIZE``), so megabytes of output cannot fill the disk;
* no core dumps.
"""

from __future__ import annotations

import argparse
import os
import resource


def apply_limits(memory_gb: float | None, file_gb: float | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if file_gb:
        size = int(file_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    cuda = os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", None) != ""
    if memory_gb and not cuda:
        size = int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kit.sandbox")
    parser.add_argument("--memory-gb", type=float, default=None)
    parser.add_argument("--file-gb", type=float, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required after --")
    apply_limits(args.memory_gb, args.file_gb)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
