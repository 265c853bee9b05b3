"""Row-parallel work (prepare's regeneration, extract): one task function over many tasks, run in this process or
by a pool of Ray actors (``cluster.executor``).

A stage cuts its work into tasks (extract: one shard each; regeneration: one batch each) and hands the executor
three things: ``make_engine`` (loads an engine: an hf model, a vLLM engine), ``run_task(engine, task) -> result``
and ``on_result(task, result)``, which the stage runs in its own process as each task finishes (it writes the
result). Both executors run the very same ``run_task``, so they produce the same bytes by construction; the
executor knows neither vLLM nor any stage.

A stage never asks which executor it has, only what the executor offers it: whether its engines run in the
stage's own process (:attr:`Executor.runs_in_driver`: they may reuse an engine the stage has loaded, and this
machine's folders), and where tasks write their results (:meth:`Executor.results_folder`: into a folder the
workers share, or back to ``on_result``).

* :class:`LocalExecutor` loads one engine and runs the tasks in turn (``cluster.executor: local``).
* :class:`RayExecutor` starts ``cluster.workers`` actors, each owning one engine, loaded once per actor; GPUs per
  actor come from the engine's ``tensor_parallel_size``, in a placement group when it spans GPUs. A small
  dispatcher over ``ray.wait`` hands each idle actor the next task. Actors restart when their process dies
  (``max_restarts=-1``) and Ray never retries a call itself (``max_task_retries=0``): a task whose actor died (its
  process killed, its node removed) is put back in the queue and run by another actor, so a finished task is
  never run again and its result arrives once. A task that fails ``cluster.max_task_retries`` times stops the
  stage naming the task and the error; an :class:`~eaglenest.core.errors.EaglenestError` raised by a task (a
  checked problem of its data, which another try would meet again) stops it at once. Results that arrived
  before are kept by ``on_result``, so the next run continues.

Both also *stream* (:meth:`Executor.stream`): the results of an endless, lazily planned sequence of tasks, handed
back in the plan's order whatever engine finished first, with at most a window of tasks taken ahead of the consumer
(its pace is the backpressure: memory stays flat however long the plan). ``extract.store: stream`` trains on such
a stream. The local executor streams from engine *processes* (a :class:`concurrent.futures.ProcessPoolExecutor`,
rebuilt and its unfinished tasks run again when one of them dies); the Ray executor from its actors, with the same
dispatcher as :meth:`Executor.run`.

Ray is imported only here and only when ``cluster.executor`` is ``ray``.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib.util
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import check_endpoint, is_loopback

if TYPE_CHECKING:
    from eaglenest.core.params import ClusterParams

log = logging.getLogger(__name__)

E = TypeVar("E")
T = TypeVar("T", bound="Task")
R = TypeVar("R")

RAY_FIX = "run `make setup` (it installs ray[default] into the project's environment)"
# A cluster started for one stage on this machine, and a loopback cluster address, keep Ray on 127.0.0.1: Ray
# otherwise swaps a loopback node address for the machine's routable one, and with a routable one its servers
# listen on every interface. This switch (meant for single-machine Ray on Windows and macOS) keeps the node on
# loopback; nodes on other machines are never loopback.
SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Nothing leaves the machine: Ray would otherwise report usage statistics to its developers' server. Calls still in
# flight when a task stops the stage are never fetched: their errors are not news (the stage names the one that is).
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_IGNORE_UNHANDLED_ERRORS": "1"}
# A cluster of our own authenticates its clients with a token (Ray's default for ray.init; set, it is also silent).
OWN_CLUSTER_ENV = {"RAY_AUTH_MODE": "token"}
# Where Ray reads a cluster's token from (besides ~/.ray/auth_token). Ray sends it only in token mode, which it
# switches on by itself for address "auto" alone: for a cluster named by host:port, token mode is asked for where
# the user has a token (scripts/cluster/ starts every cluster with one).
TOKEN_SOURCES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
CONNECT_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
# An actor that died is asked again whether its engine is up after this many seconds, doubling up to the cap: a
# restarted actor loads its model again, which takes from seconds to many minutes.
RETRY_FIRST_S, RETRY_CAP_S = 1.0, 30.0


class Task(Protocol):
    """One unit of work; ``label`` names it in messages ("shard 3 (rows 768..1023)")."""

    @property
    def label(self) -> str: ...


@dataclass(frozen=True)
class EngineNeeds:
    """What one engine takes from a node.

    Attributes:
        gpus: GPUs one engine spreads over where the cluster has GPUs (its ``tensor_parallel_size``); None for an
            engine that runs on CPUs only.
        param: The params key that sets ``gpus``, named when no node holds that many.
    """

    gpus: int | None = 1
    param: str = "tensor_parallel_size"


class Executor(Generic[E, T, R]):
    """Runs ``run_task`` over tasks with engines from ``make_engine``: :meth:`run` returns once every task has a
    result (``on_result`` has run for each), :meth:`stream` hands them back in order; both raise
    :class:`EaglenestError` naming the task that failed."""

    kind = "executor"
    workers = 1
    # The engines run in the stage's own process: they may be an engine the stage has already loaded, and they
    # see this machine's folders (a staging folder beside the output).
    runs_in_driver = False

    def __init__(self, max_task_retries: int = 3) -> None:
        self.max_task_retries = max_task_retries
        # A stream's buffer fill: results finished ahead of their turn when the last one was handed back.
        self.finished_ahead = 0

    def results_folder(self, folder: Path) -> Path | None:
        """Where tasks write their results: ``folder`` (absolute) where every engine can write into it, None where
        each result travels back to the stage's ``on_result``, which writes it."""
        raise NotImplementedError

    def run(
        self,
        make_engine: Callable[[], E],
        run_task: Callable[[E, T], R],
        tasks: Sequence[T],
        on_result: Callable[[T, R], None],
    ) -> None:
        if tasks:
            for task, result in self.finished(make_engine, run_task, tasks):
                on_result(task, result)

    def finished(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], tasks: Sequence[T]
    ) -> Iterator[tuple[T, R]]:
        """``(task, result)`` of every task (at least one) as each finishes."""
        raise NotImplementedError

    def stream(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], tasks: Iterable[T], window: int
    ) -> Iterator[tuple[T, R]]:
        """``(task, result)`` of each of ``tasks`` in their order, whichever engine finished first; at most
        ``window`` tasks are taken from ``tasks`` and not yet handed back (queued, running, or finished ahead of
        their turn). ``tasks`` is read lazily and may be endless: the consumer stops when it has had enough."""
        raise NotImplementedError

    def check_tries(self, label: str, tries: int, why: str) -> None:
        """Stops the stage once a task has failed ``cluster.max_task_retries`` times (``why``: the last failure)."""
        if tries >= self.max_task_retries:
            raise EaglenestError(
                f"{label} failed {tries} times (cluster.max_task_retries = {self.max_task_retries}); the last: {why}"
            )


def close_if_closable(engine: Any) -> None:
    """Calls ``engine.close()`` where the engine has one: an engine that holds more than memory (a vLLM engine's
    processes, a staging folder) releases it; any other is left to the garbage collector."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


# The engine of a local stream's engine process (one per process, built by its pool's initializer).
_process_engine: Any = None


def _start_process_engine(make_engine: Callable[[], Any], parent: int) -> None:
    """A local stream's engine process: dies with the process it serves, then builds its engine once, closed when
    the pool ends the process."""
    global _process_engine
    _die_with(parent)
    _process_engine = make_engine()
    multiprocessing.util.Finalize(None, close_if_closable, args=(_process_engine,), exitpriority=10)


def _die_with(parent: int) -> None:
    """Linux: this process is killed when ``parent`` dies, however it dies (a trainer killed with SIGKILL cannot
    stop its engines, and an orphaned engine would hold a verifier's memory for ever)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)


def _run_in_process_engine(run_task: Callable[[Any, Any], Any], task: Any) -> Any:
    return run_task(_process_engine, task)


def _submit(pool: ProcessPoolExecutor, run_task: Callable[[Any, Any], Any], task: Any) -> Future[Any]:
    """``task`` submitted to ``pool``; where a process of it has died already, a future holding that failure (the
    stream meets it in order, and starts a new pool then)."""
    try:
        return pool.submit(_run_in_process_engine, run_task, task)
    except BrokenProcessPool as err:
        failed: Future[Any] = Future()
        failed.set_exception(err)
        return failed


def _succeeded(future: Future[Any]) -> bool:
    """A task that finished before its pool broke: its result stands."""
    return future.done() and not future.cancelled() and future.exception() is None


class LocalExecutor(Executor[E, T, R]):
    """This machine only (``cluster.executor: local``): :meth:`run` loads one engine in this process and runs the
    tasks in order; :meth:`stream` runs ``engines`` engine processes beside this one.

    Args:
        engines: Engine processes of a stream (``cluster.workers``; 'auto' is 1).
        max_task_retries: Tries per streamed task (an engine process that dies, or an error).
    """

    kind = "local"
    runs_in_driver = True

    def __init__(self, engines: int = 1, max_task_retries: int = 3) -> None:
        super().__init__(max_task_retries)
        self.workers = engines

    def results_folder(self, folder: Path) -> Path | None:
        return folder.resolve()

    def finished(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], tasks: Sequence[T]
    ) -> Iterator[tuple[T, R]]:
        engine = make_engine()
        try:
            for task in tasks:
                yield task, run_task(engine, task)
        finally:
            close_if_closable(engine)

    def stream(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], tasks: Iterable[T], window: int
    ) -> Iterator[tuple[T, R]]:
        """As :meth:`Executor.stream`, from engine processes (spawned: a CUDA or vLLM engine cannot be forked). A
        process that dies breaks the pool: a new pool starts and every task not handed back yet runs again."""
        plan = iter(tasks)
        taken: deque[tuple[T, Future[R]]] = deque()
        tries = 0  # failed tries of the task at the head of the queue
        pool = self._pool(make_engine)
        try:
            while True:
                while len(taken) < window and (task := next(plan, None)) is not None:
                    taken.append((task, _submit(pool, run_task, task)))
                if not taken:
                    return
                task, future = taken[0]
                try:
                    result = future.result()
                except EaglenestError:
                    raise  # a checked problem of the task's data: another try would meet it again
                except BrokenProcessPool as err:
                    tries += 1
                    why = f"its engine process died, or its engine failed to start (its log is above): {err}"
                    self.check_tries(task.label, tries, why)
                    rerun = sum(1 for _, kept in taken if not _succeeded(kept))
                    log.warning("%s: an engine process died; %d tasks run again", task.label, rerun)
                    pool.shutdown(wait=True, cancel_futures=True)
                    pool = self._pool(make_engine)
                    taken = deque(
                        (again, kept if _succeeded(kept) else _submit(pool, run_task, again)) for again, kept in taken
                    )
                    continue
                except Exception as err:  # counted: the stage stops with it after the last try
                    tries += 1
                    self.check_tries(task.label, tries, error_line(err))
                    log.warning("%s failed: %s; it runs again", task.label, error_line(err))
                    taken[0] = (task, _submit(pool, run_task, task))
                    continue
                taken.popleft()
                tries = 0
                self.finished_ahead = sum(1 for _, ahead in taken if _succeeded(ahead))
                yield task, result
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _pool(self, make_engine: Callable[[], E]) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_process_engine,
            initargs=(make_engine, os.getpid()),
        )


class EngineHost:
    """The actor class: one engine, built on first use (so that a failure to build it comes back as the error of
    a call, with its message, instead of killing the actor), and the task function."""

    def __init__(self, make_engine: Callable[[], Any], run_task: Callable[[Any, Any], Any]) -> None:
        self._make_engine, self._run_task = make_engine, run_task
        self._engine: Any = None
        self._started = False

    def start(self) -> str:
        """Builds the engine if this process has none yet; returns where it runs."""
        if not self._started:
            self._engine = self._make_engine()
            self._started = True
        import ray

        context = ray.get_runtime_context()
        return f"node {context.get_node_id()[:8]}, pid {os.getpid()}"

    def run(self, task: Any) -> Any:
        self.start()  # a restarted actor meets its first task before the driver's start call
        return self._run_task(self._engine, task)

    def close(self) -> None:
        if self._started:
            close_if_closable(self._engine)
            self._started, self._engine = False, None


class ActorState(enum.Enum):
    """Where one actor of a :class:`RayExecutor` stands, as its dispatcher sees it."""

    STARTING = "starting"  # its start call (the engine loading) is in flight
    IDLE = "idle"  # its engine is up and it has no task
    BUSY = "busy"  # a task is in flight on it
    DOWN = "down"  # its process died: it is asked to start again at its retry_at
    DROPPED = "dropped"  # its engine failed to start cluster.max_task_retries times: never asked again


ENGINE_UP = (ActorState.IDLE, ActorState.BUSY)


@dataclass
class _Actor:
    """The dispatcher's view of one actor."""

    handle: Any
    state: ActorState = ActorState.STARTING
    where: str = ""
    retry_at: float = 0.0
    backoff: float = RETRY_FIRST_S
    start_failures: int = 0


@dataclass
class _Dispatch(Generic[T, R]):
    """What is planned, queued, in flight and finished, and how often each task failed; tasks are known by their
    place in the plan.

    Attributes:
        plan: The tasks not taken yet, with their places.
        window: At most this many tasks taken and not yet handed back; None: every task at once.
        ordered: Results are handed back in the plan's order (a stream), else as they finish.
    """

    plan: Iterator[tuple[int, T]]
    window: int | None
    ordered: bool
    pending: deque[tuple[int, T]] = field(default_factory=deque)
    inflight: dict[Any, tuple[int, tuple[int, T] | None]] = field(default_factory=dict)  # ref -> (actor, task)
    tries: dict[int, int] = field(default_factory=dict)  # place -> failed tries
    finished: dict[int, tuple[T, R]] = field(default_factory=dict)  # results waiting for their turn
    next_place: int = 0  # the next result to hand back (ordered)
    taken: int = 0
    exhausted: bool = False

    def take(self) -> None:
        """Queues tasks from the plan while the window has room."""
        while not self.exhausted and (self.window is None or self.taken - self.next_place < self.window):
            item = next(self.plan, None)
            if item is None:
                self.exhausted = True
            else:
                self.pending.append(item)
                self.taken += 1

    def unfinished(self) -> bool:
        return bool(self.pending) or self.tasks_in_flight() or not self.exhausted

    def tasks_in_flight(self) -> bool:
        return any(task is not None for _, task in self.inflight.values())

    def handed_back(self, place: int, task: T, result: R) -> Iterator[tuple[T, R]]:
        """The results that may go to the consumer now that ``place`` has finished."""
        if not self.ordered:
            self.next_place += 1
            yield task, result
            return
        self.finished[place] = (task, result)
        while self.next_place in self.finished:
            done = self.finished.pop(self.next_place)
            self.next_place += 1
            yield done

    def finished_ahead(self) -> int:
        return len(self.finished)


def error_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


class RayExecutor(Executor[E, T, R]):
    """A pool of Ray actors, one engine each, fed by a dispatcher over ``ray.wait`` (see the module docstring).

    Args:
        cluster: The ``cluster`` params (workers, CPUs per worker, tries per task).
        needs: What one engine takes from a node.
    """

    kind = "ray"

    def __init__(self, cluster: ClusterParams, needs: EngineNeeds) -> None:
        super().__init__(cluster.max_task_retries)
        self.cluster, self.needs = cluster, needs
        self.options, self.workers, self.description = plan_engines(cluster, needs, alive_nodes())

    def results_folder(self, folder: Path) -> Path | None:
        """``folder`` with ``cluster.output: shared`` (every node mounts it at the same path); else None."""
        return folder.resolve() if self.cluster.output == "shared" else None

    def finished(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], tasks: Sequence[T]
    ) -> Iterator[tuple[T, R]]:
        dispatch: _Dispatch[T, R] = _Dispatch(enumerate(tasks), window=None, ordered=False)
        count = min(self.workers, len(tasks))
        log.info("ray: %d engines (%s) for %d tasks", count, self.description, len(tasks))
        return self._dispatched(make_engine, run_task, dispatch, count)

    def stream(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], tasks: Iterable[T], window: int
    ) -> Iterator[tuple[T, R]]:
        dispatch: _Dispatch[T, R] = _Dispatch(enumerate(tasks), window=window, ordered=True)
        log.info("ray: %d engines (%s) streaming, %d tasks ahead at most", self.workers, self.description, window)
        yield from self._dispatched(make_engine, run_task, dispatch, self.workers)

    def _dispatched(
        self, make_engine: Callable[[], E], run_task: Callable[[E, T], R], dispatch: _Dispatch[T, R], count: int
    ) -> Iterator[tuple[T, R]]:
        """The dispatcher: ``count`` actors, each idle one handed the next queued task, results handed back as
        ``dispatch`` says; the actors end with it (also when the consumer stops early)."""
        import ray

        host = ray.remote(max_restarts=-1, max_task_retries=0)(EngineHost)
        actors = [_Actor(host.options(**self.actor_options()).remote(make_engine, run_task)) for _ in range(count)]
        try:
            for index, actor in enumerate(actors):
                dispatch.inflight[actor.handle.start.remote()] = (index, None)
            dispatch.take()
            while dispatch.unfinished():
                self._assign(actors, dispatch)
                self._revive(actors, dispatch)
                if not dispatch.inflight:
                    self._check_capacity(actors)
                    time.sleep(self._next_retry(actors))
                    continue
                ready, _ = ray.wait(list(dispatch.inflight), num_returns=1, timeout=self._next_retry(actors))
                for ref in ready:
                    finished = self._collect(ref, actors, dispatch)
                    if finished is not None:
                        for handed in dispatch.handed_back(*finished):
                            self.finished_ahead = dispatch.finished_ahead()
                            yield handed
                        dispatch.take()
                if not ready:  # a wait ran out: every engine may be gone with the nodes that held it
                    self._check_capacity(actors)
        finally:
            self._shut_down(actors)

    def actor_options(self) -> dict[str, Any]:
        """Ray options of one actor; a placement group per engine that spans GPUs (all on one node)."""
        if "placement_bundles" not in self.options:
            return dict(self.options)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group(self.options["placement_bundles"], strategy="STRICT_PACK")
        # The engine's own workers (vLLM's, one per GPU) are scheduled into the group by the engine.
        return {
            "num_cpus": 0,
            "num_gpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True),
        }

    def _assign(self, actors: list[_Actor], dispatch: _Dispatch[T, R]) -> None:
        for index, actor in enumerate(actors):
            if actor.state is ActorState.IDLE and dispatch.pending:
                item = dispatch.pending.popleft()
                dispatch.inflight[actor.handle.run.remote(item[1])] = (index, item)
                actor.state = ActorState.BUSY

    def _revive(self, actors: list[_Actor], dispatch: _Dispatch[T, R]) -> None:
        """Asks each actor that died, once its wait is over, to start again (Ray restarts its process)."""
        now = time.monotonic()
        for index, actor in enumerate(actors):
            if actor.state is ActorState.DOWN and actor.retry_at <= now:
                dispatch.inflight[actor.handle.start.remote()] = (index, None)
                actor.state = ActorState.STARTING

    @staticmethod
    def _next_retry(actors: list[_Actor]) -> float:
        """Seconds until the next actor that died is asked again; at most ``RETRY_CAP_S``."""
        waits = [actor.retry_at - time.monotonic() for actor in actors if actor.state is ActorState.DOWN]
        return max(0.05, min([RETRY_CAP_S, *waits]))

    def _check_capacity(self, actors: list[_Actor]) -> None:
        """No engine is up: stop if the nodes left cannot hold a single engine (they will not come back; an actor
        waiting for a node would wait for ever)."""
        if any(actor.state in ENGINE_UP for actor in actors):
            return
        try:
            plan_engines(self.cluster.model_copy(update={"workers": "auto"}), self.needs, alive_nodes())
        except EaglenestError as err:
            raise EaglenestError(f"every engine was lost and the cluster cannot start another: {err}") from None

    def _collect(self, ref: Any, actors: list[_Actor], dispatch: _Dispatch[T, R]) -> tuple[int, T, R] | None:
        """One call's outcome: a finished task as ``(place, task, result)``; None for a start call, or a task that
        failed (queued again, or the stage stops)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        index, item = dispatch.inflight.pop(ref)
        actor = actors[index]
        try:
            value = ray.get(ref)
        except RayActorError as err:  # the actor's process or node died: its task (if any) goes back in the queue
            if item is not None:
                log.warning(
                    "ray: %s: its engine (%s) was lost (%s); it runs again",
                    item[1].label,
                    actor.where or "?",
                    type(err).__name__,
                )
                self._failed(item, dispatch, f"its engine was lost ({type(err).__name__})")
            if err.actor_init_failed:  # the worker could not even create the actor (an import failed there)
                self._start_failed(actor, actors, err)
            else:
                self._down(actor)
            return None
        except RayTaskError as err:
            cause = err.cause if err.cause is not None else err
            if isinstance(cause, EaglenestError):  # checked, so another try would meet it again
                raise EaglenestError(f"{item[1].label}: {cause}" if item is not None else str(cause)) from None
            if item is None:
                self._start_failed(actor, actors, cause)
                return None
            actor.state = ActorState.IDLE
            log.warning("ray: %s failed on %s: %s", item[1].label, actor.where, error_line(cause))
            self._failed(item, dispatch, error_line(cause))
            return None
        if item is None:
            actor.state, actor.where, actor.backoff = ActorState.IDLE, str(value), RETRY_FIRST_S
            log.info("ray: engine %d ready (%s)", index, actor.where)
            return None
        actor.state = ActorState.IDLE
        return item[0], item[1], value

    def _failed(self, item: tuple[int, T], dispatch: _Dispatch[T, R], why: str) -> None:
        tries = dispatch.tries[item[0]] = dispatch.tries.get(item[0], 0) + 1
        self.check_tries(item[1].label, tries, why)
        dispatch.pending.appendleft(item)

    def _start_failed(self, actor: _Actor, actors: list[_Actor], cause: BaseException) -> None:
        actor.start_failures += 1
        log.warning("ray: an engine failed to start: %s", error_line(cause))
        if actor.start_failures >= self.cluster.max_task_retries:
            actor.state = ActorState.DROPPED
            if all(other.state is ActorState.DROPPED for other in actors):
                raise EaglenestError(f"no engine could start on the cluster; the last failure: {error_line(cause)}")
        else:
            self._down(actor)

    @staticmethod
    def _down(actor: _Actor) -> None:
        """The actor is asked again after its wait, which doubles each time (up to ``RETRY_CAP_S``)."""
        actor.state, actor.retry_at = ActorState.DOWN, time.monotonic() + actor.backoff
        actor.backoff = min(RETRY_CAP_S, actor.backoff * 2)

    @staticmethod
    def _shut_down(actors: list[_Actor]) -> None:
        """Closes the engines of idle actors (a vLLM engine's own processes), then ends every actor; one still busy
        (the stage stops on another task's error) is ended at once, and Ray ends its children with it."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        closing = [actor.handle.close.remote() for actor in actors if actor.state is ActorState.IDLE]
        with contextlib.suppress(RayError, GetTimeoutError):
            ray.get(closing, timeout=60)
        for actor in actors:
            with contextlib.suppress(RayError):
                ray.kill(actor.handle, no_restart=True)


def alive_nodes() -> list[dict[str, float]]:
    """The resources (``CPU``, ``GPU``, ...) of every node of the connected cluster that is alive."""
    import ray

    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def plan_engines(
    cluster: ClusterParams, needs: EngineNeeds, nodes: list[dict[str, float]]
) -> tuple[dict[str, Any], int, str]:
    """(one actor's Ray options, engines to start, a description) for ``nodes``.

    On a cluster with GPUs an engine takes ``needs.gpus`` of one node's GPUs (and a CPU per GPU); elsewhere
    ``cluster.cpus_per_worker`` CPUs. ``cluster.workers: auto`` starts as many engines as the nodes hold.

    Raises:
        EaglenestError: no node holds one engine (one line: what an engine needs, what the largest node has).
    """
    max_gpus = max((node.get("GPU", 0.0) for node in nodes), default=0.0)
    gpus = needs.gpus if needs.gpus is not None and sum(node.get("GPU", 0.0) for node in nodes) > 0 else None
    if gpus is not None:
        if max_gpus < gpus:
            raise EaglenestError(
                f"{needs.param} = {gpus}: an engine needs {gpus} GPUs on one node, and the largest node of the Ray "
                f"cluster has {max_gpus:g}; lower {needs.param} or add nodes with more GPUs"
            )
        fit = sum(int(node.get("GPU", 0.0) // gpus) for node in nodes)
        options: dict[str, Any] = (
            {"num_gpus": 1, "num_cpus": 1} if gpus == 1 else {"placement_bundles": [{"GPU": 1, "CPU": 1}] * gpus}
        )
        per_engine = f"{gpus} GPU{'s' if gpus > 1 else ''} each"
    else:
        cpus = cluster.cpus_per_worker
        fit = sum(int(node.get("CPU", 0.0) // cpus) for node in nodes)
        if fit == 0:
            largest = max((node.get("CPU", 0.0) for node in nodes), default=0.0)
            raise EaglenestError(
                f"cluster.cpus_per_worker = {cpus}: no node of the Ray cluster has that many CPUs (the largest has "
                f"{largest:g}, in {len(nodes)} nodes alive); lower it or add nodes"
            )
        options = {"num_cpus": cpus, "num_gpus": 0}
        per_engine = f"{cpus} CPU{'s' if cpus > 1 else ''} each"
    wanted = fit if cluster.workers == "auto" else int(cluster.workers)
    if wanted > fit:
        log.warning(
            "cluster.workers = %d, but the cluster holds %d engines of %s: starting %d", wanted, fit, per_engine, fit
        )
        wanted = fit
    return options, wanted, f"{per_engine}, on {len(nodes)} nodes"


def _probe(address: str) -> str:
    """Refuses a host:port where nothing answers (``ray.init`` would retry it for minutes); returns its host."""
    try:
        host, port = check_endpoint(address)
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return host
    except (OSError, ValueError) as err:
        raise EaglenestError(
            f"cluster.address = {address!r}: no Ray cluster answers there ({err}); start its head there with "
            "`ray start --head --port=6379` (scripts/cluster/ has SLURM and Kubernetes launchers), point "
            "cluster.address at a running head, or set cluster.address: local to start one on this machine"
        ) from None


def require_ray() -> None:
    """Refuses ``cluster.executor: ray`` where this interpreter has no Ray (one line, with the fix); imports
    nothing (Ray reads some of its switches from the environment when it is first imported)."""
    if importlib.util.find_spec("ray") is None:
        raise EaglenestError(f"cluster.executor: ray needs Ray, which this interpreter lacks; {RAY_FIX}")


def check_cluster(cluster: ClusterParams) -> None:
    """Refuses, before any work, ``cluster.executor: ray`` without Ray installed, or a host:port where nothing
    answers (one line each, with the fix); connecting waits until there is work."""
    if cluster.executor != "ray":
        return
    require_ray()
    address = os.environ.get("RAY_ADDRESS", "auto") if cluster.address == "auto" else cluster.address
    if address not in ("local", "auto"):
        _probe(address)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ (those the user set keep theirs) while the block runs, for Ray's processes too."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _package_dir() -> Path:
    import eaglenest

    return Path(eaglenest.__file__).resolve().parent


@contextlib.contextmanager
def connect(cluster: ClusterParams) -> Iterator[None]:
    """Connected to the Ray cluster of ``cluster.address`` (started for the block when 'local'), with this
    checkout's eaglenest shipped to every worker (Ray's ``py_modules``: no shared filesystem needed for the
    code); disconnected (a started cluster stopped) afterwards.

    Raises:
        EaglenestError: Ray is not installed, or no cluster answers at the address (one line, with the fix).
    """
    address = cluster.address
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    env = dict(QUIET_ENV)
    kwargs: dict[str, Any] = {}
    if address == "local":
        env |= SINGLE_MACHINE_ENV | OWN_CLUSTER_ENV
        kwargs["include_dashboard"] = False
    elif address != "auto":
        if is_loopback(_probe(address)):
            env |= SINGLE_MACHINE_ENV
        if any(os.environ.get(name) for name in TOKEN_SOURCES) or (Path.home() / ".ray" / "auth_token").is_file():
            env |= OWN_CLUSTER_ENV  # a RAY_AUTH_MODE the user set keeps theirs
    require_ray()
    with _environment(env):  # before Ray's first import: it reads the single-machine switch then
        import ray

        try:
            ray.init(
                address=address,
                runtime_env={"py_modules": [str(_package_dir())]},
                logging_level=logging.WARNING,
                **kwargs,
            )
        except ConnectionError as err:
            raise EaglenestError(
                f"cluster.address = {cluster.address!r}: {error_line(err).rstrip('.')}; start a cluster with "
                "`ray start --head` (scripts/cluster/ has SLURM and Kubernetes launchers), or set cluster.address: "
                "local to start one on this machine"
            ) from None
        try:
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def open_executor(cluster: ClusterParams, needs: EngineNeeds) -> Iterator[Executor[Any, Any, Any]]:
    """The executor ``cluster.executor`` names, connected for the block.

    Raises:
        EaglenestError: as :func:`connect`, or no node holds one engine (:func:`plan_engines`); before any work.
    """
    if cluster.executor == "local":
        yield LocalExecutor(1 if cluster.workers == "auto" else cluster.workers, cluster.max_task_retries)
        return
    with connect(cluster):
        yield RayExecutor(cluster, needs)


def in_this_process(cluster: ClusterParams, why: str) -> ClusterParams:
    """``cluster`` with its tasks run by this process, for work bound to this machine (``why`` says how; it is
    logged where that sets another ``cluster.executor`` aside)."""
    if cluster.executor == "local":
        return cluster
    log.info("%s; cluster.executor: %s is not used", why, cluster.executor)
    return cluster.model_copy(update={"executor": "local"})


def describe_cluster(cluster: ClusterParams) -> list[str]:
    """What ``cluster`` would run on, for ``eaglenest doctor``: a line per fact.

    Raises:
        EaglenestError: Ray is missing, or no cluster answers at ``cluster.address``.
    """
    if cluster.executor == "local":
        return ["cluster: executor local (one process on this machine; cluster.executor: ray shares the work)"]
    if cluster.address == "local":
        require_ray()  # only whether it is there: a local cluster is started by the stage itself
        import torch

        return [
            f"cluster: executor ray, address local: the stage starts Ray on this machine (127.0.0.1): "
            f"{len(os.sched_getaffinity(0))} CPUs, {torch.cuda.device_count()} GPUs"
        ]
    with connect(cluster):
        nodes = alive_nodes()
    cpus = sum(node.get("CPU", 0.0) for node in nodes)
    gpus = sum(node.get("GPU", 0.0) for node in nodes)
    return [f"cluster: executor ray at {cluster.address}: {len(nodes)} nodes alive, {cpus:g} CPUs, {gpus:g} GPUs"]
