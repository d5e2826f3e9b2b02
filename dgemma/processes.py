"""Processes dgemma starts end when what started them ends, even by SIGKILL (Linux).

A split server's ranks (started by torch.distributed's launcher) and a Ray Serve replica's split server are
children whose parent may be killed without a chance to stop them (an OOM kill, a supervisor's SIGKILL, Ray
killing a replica's process): left alone, a rank 0 would go on serving its port and the other ranks would wait
on it. `end_with_parent` asks the kernel to send SIGTERM, which they handle as a stop, when the parent ends.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def end_with_parent(signum: int = signal.SIGTERM):
    """Have the kernel send `signum` to this process when its parent ends; sent at once if the parent already
    has. The kernel watches the parent *thread* that started this process: start it from a thread that lives as
    long as the parent does. Nothing happens off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) != 0:
        return  # not allowed here (a sandbox): the parent's own stop still ends the child
    if os.getppid() != parent:  # the parent ended before the request took hold
        os.kill(os.getpid(), signum)
