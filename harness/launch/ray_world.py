"""Ranks as Ray actors: the persistent world on the engine RL frameworks already run (SkyRL, verl,
NeMo-RL and slime run their Megatron workers as Ray actors in placement groups), and the path to
more than one machine.

One actor per rank, in a placement group of one bundle per rank (`STRICT_PACK` by default: one
node; `PACK`, `SPREAD`, `STRICT_SPREAD` as asked), a GPU in each bundle on CUDA. Rendezvous goes
through the actors: rank 0's actor opens the TCPStore on its node and every rank joins at rank 0's
address. A call is one actor task per rank running the same `harness.launch.rank.execute` as a
process rank; a timeout asks each hung actor for its stacks through a second thread (the actors'
"control" concurrency group) and a dead actor fails the call as soon as Ray reports it. Closing
kills the actors and removes the placement group.

Ray must be initialized by the caller (`ray.init(...)`; the pytest plugin does it once per
session, or attaches to `RAY_ADDRESS` / `--mrh-ray-address`).
"""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Any, TextIO

from harness.launch.base import WorldBase, make_workdir, tail
from harness.launch.rank import RankSpec, _read_from, all_stacks, execute, join_reply, prepare

PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_live: "weakref.WeakSet[RayWorld]" = weakref.WeakSet()
_ACTOR_CLASS = None


def _actor_class():
    """The rank actor, made once Ray is imported (the harness imports without Ray)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is not None:
        return _ACTOR_CLASS
    import ray

    @ray.remote(concurrency_groups={"control": 1}, max_restarts=0)
    class RankActor:
        """One rank: `join` once, then `call` per world call; `stacks`/`log` answer while a call runs."""

        def __init__(self) -> None:
            self.spec: RankSpec | None = None
            self.store = None

        @ray.method(concurrency_group="control")
        def node(self) -> dict[str, Any]:
            import socket

            return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                    "pid": os.getpid(), "host": socket.gethostname()}

        def open_store(self, world_size: int, timeout_s: float) -> int:
            """Rank 0: host the rendezvous store on this node; returns its port."""
            from datetime import timedelta

            import torch.distributed as dist

            self.store = dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout_s))
            return self.store.port

        def join(self, spec: RankSpec) -> tuple:
            prepare(spec, stack_signal=False)  # an actor method may run off the main thread
            self.spec = spec
            return join_reply(spec)

        def call(self, message: tuple) -> tuple:
            return execute(self.spec, message)

        @ray.method(concurrency_group="control")
        def stacks(self) -> str:
            return all_stacks()

        @ray.method(concurrency_group="control")
        def log(self) -> str:
            return _read_from(self.spec.log_path, 0) if self.spec else ""

        @ray.method(concurrency_group="control")
        def ping(self) -> bool:
            return True

    _ACTOR_CLASS = RankActor
    return RankActor


class RayWorld(WorldBase):
    """`RayWorld(size, device="cpu", placement="STRICT_PACK")`: `size` rank actors, the same API and
    guarantees as the process `World`. Needs an initialized Ray (`ray.init`)."""

    launcher = "ray"

    def __init__(self, size: int, device: str = "cpu", *, placement: str = "STRICT_PACK", timeout: float = 300.0,
                 start_timeout: float = 180.0, failure_grace: float = 5.0, death_grace: float = 1.0,
                 env: dict[str, str] | None = None, echo_output: bool = True, echo_to: TextIO | None = None,
                 ping_timeout: float = 10.0, spec: str | None = None):
        super().__init__(size, device, timeout=timeout, start_timeout=start_timeout, failure_grace=failure_grace,
                         death_grace=death_grace, env=env, echo_output=echo_output, echo_to=echo_to, spec=spec)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        self.ping_timeout = ping_timeout
        self.nodes: list[dict[str, Any]] = []  # per rank: ip, node_id, pid, host
        self._actors: list[Any] = []
        self._group = None
        self._inflight: list[Any] = []
        self._workdir: str | None = None
        self._death_notes: dict[int, str] = {}  # rank -> Ray's first line about its death
        self._driver_node: str | None = None  # ranks on it are watched by pid
        _live.add(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        if not self._actors:
            return False
        import ray

        pings = [actor.ping.remote() for actor in self._actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=self.ping_timeout)
        if len(ready) < len(pings):
            return False
        try:
            ray.get(ready)
        except ray.exceptions.RayError:
            return False
        return True

    @property
    def pids(self) -> list[int]:
        return [node["pid"] for node in self.nodes]

    @property
    def workdir(self) -> str | None:
        return self._workdir

    def _start_ranks(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init() (or attach with RAY_ADDRESS) first")
        bundle = {"CPU": 1, "GPU": 1} if self.device == "cuda" else {"CPU": 1}
        self._group = placement_group([dict(bundle) for _ in range(self.size)], strategy=self.placement)
        ready, _ = ray.wait([self._group.ready()], timeout=self.start_timeout)
        if not ready:
            raise RuntimeError(f"the cluster cannot place {self.size} bundles of {bundle} with {self.placement} "
                               f"within {self.start_timeout:.0f} s (available: {ray.available_resources()})")
        actor = _actor_class()
        self._actors = [
            actor.options(num_cpus=1, num_gpus=1 if self.device == "cuda" else 0, name=None,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self._group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.size)]
        self.nodes = ray.get([a.node.remote() for a in self._actors], timeout=self.start_timeout)
        port = ray.get(self._actors[0].open_store.remote(self.size, self.start_timeout), timeout=self.start_timeout)
        # Each rank's log lives on its own node; on one machine they share this directory.
        self._workdir = make_workdir(f"mrh-rayworld{self.size}-{self.device}-")
        specs = [RankSpec(rank=rank, world_size=self.size, device=self.device, store_host=self.nodes[0]["ip"],
                          store_port=port, workdir=self._workdir, parent_pid=os.getpid(),
                          pg_timeout_s=max(self.timeout, self.start_timeout), env=self.env)
                 for rank in range(self.size)]
        self._driver_node = ray.get_runtime_context().get_node_id()
        self._inflight = [a.join.remote(spec) for a, spec in zip(self._actors, specs)]
        self._collect(self._open_call("start", self.start_timeout, "start", sent=True), self.start_timeout)

    def close(self) -> None:
        """Kill every rank actor and remove the placement group (nothing is left in the cluster)."""
        self._kill()

    def _kill(self) -> None:
        self._forget_call()
        if self._actors or self._group is not None:
            import ray

            for actor in self._actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already gone
                    pass
            if self._group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self._group)
                except Exception:  # the cluster went away
                    pass
        self._actors, self._group, self._inflight, self.nodes = [], None, [], []
        if self._workdir:
            import shutil

            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # ------------------------------------------------------------------ calls
    def _send(self, message: tuple) -> None:
        self._inflight = [actor.call.remote(message) for actor in self._actors]

    def _poll(self, pending: set[int], timeout: float) -> list[tuple[int, str, Any]]:
        import ray

        refs = {self._inflight[rank]: rank for rank in pending}
        # Ray reports a dead actor's task only after ~30 s here; a rank on this node is watched by
        # its pid, so its death fails the call within a second.
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=min(timeout, 0.5))
        news = []
        for ref in ready:
            rank = refs[ref]
            try:
                news.append((rank, "reply", ray.get(ref)))
            except ray.exceptions.ActorDiedError as exc:  # Ray names no exit code
                self._death_notes[rank] = (str(exc).strip().splitlines() or [""])[0]
                news.append((rank, "died", None))
            except ray.exceptions.RayTaskError as exc:  # the actor method itself broke
                news.append((rank, "error", str(exc)))
        for ref, rank in refs.items():
            if ref not in ready and not self._pid_alive(rank):
                self._death_notes[rank] = f"its process (pid {self.nodes[rank]['pid']}) is gone"
                news.append((rank, "died", None))
        return news

    def _pid_alive(self, rank: int) -> bool:
        """False only for a rank on this node whose process is gone (a remote one: Ray tells)."""
        import psutil

        if rank >= len(self.nodes) or self.nodes[rank]["node_id"] != self._driver_node:
            return True
        try:
            return psutil.Process(self.nodes[rank]["pid"]).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    # ------------------------------------------------------------------ failures
    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        return self._ask(ranks, "stacks")

    def _log_tail(self, rank: int) -> str:
        note = self._death_notes.pop(rank, "")
        text = self._ask([rank], "log").get(rank, "")
        return (f"    | (ray) {note}\n" if note else "") + tail(text)

    def _ask(self, ranks: list[int], method: str, wait_s: float = 5.0) -> dict[int, str]:
        import ray

        refs = {getattr(self._actors[r], method).remote(): r for r in ranks if r < len(self._actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s) if refs else ([], [])
        out = {}
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError:
                pass
        return out


def _kill_live() -> None:
    for world in list(_live):
        world._kill()


atexit.register(_kill_live)
