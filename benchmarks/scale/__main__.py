"""How checkpoint coordination grows with the job: one place, one command.

    python benchmarks/scale real [...]   real ranks on this machine: many tensors, 8-16 ranks,
                                         a 2-"node" torchrun run; dmuon against torch DCP
                                         (``scale_real.py``)
    python benchmarks/scale sim [...]    64 to 16,384 simulated ranks in one process, running
                                         the code as it is in the tree (``scale_sim.py``)
    python benchmarks/scale sim --check-real
                                         the simulator's byte counts against real gloo ranks
                                         (``scale_sim_real.py``)

``python benchmarks/scale real --help`` (or ``sim --help``) lists each one's options.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE):  # repo, benchmarks, here
    if path not in sys.path:
        sys.path.insert(0, path)

TOOLS = {"real": "scale_real", "sim": "scale_sim"}


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in TOOLS:
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    tool = __import__(TOOLS[argv[0]])
    sys.argv = [f"{sys.argv[0]} {argv[0]}", *argv[1:]]  # (each tool's --help names its command)
    tool.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
