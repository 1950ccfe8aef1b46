"""torch workarounds, applied in each CPU-tier rank process (harness.launch.rank), each gated on the torch
versions it was verified on (stack A's 2.13.0, stack B's 2.15.0).

- `GLOO_SHARED_DEVICE` (found by this harness): c10d's `ProcessGroupGloo(store, rank, size, timeout)`
  (torch/csrc/distributed/c10d/init.cpp) builds its options with a new default TCP device for every process
  group, and every gloo TCP device starts its own event-loop thread (`gloo_tcp_loop`, gloo/transport/tcp/
  loop.cc) that wakes every 10 ms (`epoll_wait(..., 10)`) whether or not the group is used. Megatron makes
  a few dozen groups per layout (tp, pp, dp, the embedding and position groups, their gloo twins, the expert
  ones) and never destroys them while a world is reused across layouts: a CPU-tier rank held 30 to 133 such
  threads, and the two-core CI machine spent its time waking them (load average 60-70, world starts past
  their 180 s timeout). The workaround gives every gloo group of a process the same TCP device (one loop
  thread; gloo multiplexes pairs of many contexts on one device: `new_group` with explicit options does
  the same) with two worker threads, as the stock options have. Measured on this machine with torch 2.13.0:
  61 groups' loop threads -> 1, creating 60 groups and an allreduce on each 11.6 s -> 3.2 s, an idle
  rank's CPU over 3 s 0.26 s -> 0 (suites/harness/test_layout_switch.py counts the threads each run).

The gate: `share_gloo_device` raises `UnverifiedTorchError` on a torch version the workaround was not
verified on, before anything changes. Re-verify with suites/harness/test_layout_switch.py, then add the
version to `verified_on`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from harness.compat import refuse_unverified


class UnverifiedTorchError(RuntimeError):
    """A workaround was asked for on a torch version it was not verified on."""


@dataclass(frozen=True)
class Workaround:
    name: str
    bug: str  # the upstream behaviour it works around, in one line
    verified_on: tuple[str, ...]  # torch.__version__ without its local part (+cpu, +cu130)


GLOO_SHARED_DEVICE = Workaround(
    "gloo-shared-device", "every ProcessGroupGloo made from a store gets its own TCP device, each with an "
    "event-loop thread waking every 10 ms for the life of the group", ("2.13.0", "2.15.0"))
WORKAROUNDS = (GLOO_SHARED_DEVICE,)
LOOP_THREAD = "gloo_tcp_loop"  # the loop thread's name (gloo/transport/tcp/loop.cc)


def version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def share_gloo_device() -> None:
    """Every gloo group made in this process from now on uses one TCP device (`GLOO_SHARED_DEVICE`).
    Idempotent."""
    import torch.distributed.distributed_c10d as c10d

    stock = c10d.ProcessGroupGloo
    if getattr(stock, "_harness_shared_device", False):
        return
    refuse_unverified(UnverifiedTorchError, "torch", version(), GLOO_SHARED_DEVICE.name,
                      GLOO_SHARED_DEVICE.verified_on, "suites/harness/test_layout_switch.py")
    device = []  # made at the first group: creating a device resolves the host name

    class SharedDeviceGloo(stock):
        _harness_shared_device = True

        def __init__(self, store, rank, size, timeout=None, enable_reconfigure=False):
            if isinstance(timeout, stock._Options):  # already explicit options: the caller chose
                super().__init__(store, rank, size, timeout)
                return
            if not device:
                device.append(stock.create_default_device())
            options = stock._Options()
            options._devices = [device[0]]
            options._threads = 2  # the stock options' worker threads
            if timeout is not None:
                options._timeout = timeout
            # torch 2.15 passes enable_reconfigure (False unless asked) as a keyword of the timeout
            # constructor; the options constructor takes it as an option (2.13 has neither)
            if enable_reconfigure:
                options.enable_reconfigure = True
            super().__init__(store, rank, size, options)

    SharedDeviceGloo.__name__ = SharedDeviceGloo.__qualname__ = "ProcessGroupGloo"
    c10d.ProcessGroupGloo = SharedDeviceGloo


def gloo_loop_threads() -> int:
    """How many gloo TCP event-loop threads this process runs (Linux: /proc/self/task/*/comm)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == LOOP_THREAD
        except OSError:  # the thread ended while we looked
            pass
    return count
