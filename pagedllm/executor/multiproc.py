"""Tensor parallelism over worker processes on one machine (`tensor_parallel_size=N`).

Rank 0 is the engine-core process itself (its `Worker` is the driver); ranks 1..N-1 are worker
processes (executor/worker_proc.py) started here. All N join one torch.distributed group (gloo
on CPU, NCCL on CUDA) and load their own shards at the same time. Each step the scheduler's
plan (core/step_plan.py: the block tables as the scheduler's deltas) is encoded once without its
rank-0-only parts and written to every worker's link; then every rank runs the same forward, the collectives keeping them in step, and
only rank 0 gets logits back. There is no reply per step.

Failures are start-up errors or clear run-time errors, never hangs:
- each start-up stage has a deadline, and a worker's exception comes back as its traceback
  inside the RuntimeError the engine raises (its exit code when it died without one);
- a worker that dies mid-run breaks the next collective at once (its sockets close) or is
  seen dead before the next step; the executor then raises naming the rank, and every later
  call raises the same error;
- workers exit on `shutdown`, when their link closes, or when their parent is gone
  (worker_proc's watchdog); `shutdown` also runs when the executor is collected and at exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from pagedllm import envs
from pagedllm.distributed import cpu_binding, parallel_state
from pagedllm.executor.base import Executor
from pagedllm.executor.channel import Listener, free_port
from pagedllm.core.step_plan import StepPlan, encode_for_workers
from pagedllm.executor.worker_proc import AUTHKEY_ENV
from pagedllm.worker.memory_sizing import MemoryProfile
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = envs.PAGEDLLM_TP_START_TIMEOUT_S


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker failed or died; the message names the rank and shows its
    traceback when it sent one."""


def check_tensor_parallel_devices(device_type: str, world: int, visible_gpus: int | None = None) -> None:
    """ValueError when `world` ranks cannot have a GPU each."""
    if device_type != "cuda":
        return
    visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    if world > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, but {visible} are visible"
                         + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
                         + f"; use tensor_parallel_size <= {visible} or make more GPUs visible")


class _Proc:
    """One worker and its link. `popen` is a `subprocess.Popen`, or anything with its `poll`,
    `wait`, `terminate`, `kill` (executor/ray_executor.py's actor handle, which also says how it
    ended: `exit_text`)."""

    def __init__(self, rank: int, popen: Any) -> None:
        self.rank = rank
        self.popen = popen
        self.pid: int | None = getattr(popen, "pid", None)  # else from its hello
        self.conn: Connection | None = None
        self.error: str | None = None  # a traceback it sent

    def describe(self) -> str:
        code = self.popen.poll()
        if code is None:
            state = "running"
        else:
            state = self.popen.exit_text() if hasattr(self.popen, "exit_text") else f"exited with code {code}"
        text = f"tensor-parallel worker rank {self.rank} (pid {self.pid}, {state})"
        return text + (f":\n{self.error}" if self.error else "")


class MultiprocExecutor(Executor):
    def __init__(self, config: WorkerConfig) -> None:
        self.world_size = world = config.tensor_parallel_size
        if world < 2:
            raise ValueError("MultiprocExecutor is for tensor_parallel_size > 1")
        self._check_devices(config)
        if parallel_state.tp_group().world_size > 1:  # torch.distributed: one default group per process
            raise RuntimeError("this process already runs a tensor-parallel engine (it is rank 0 of its group); "
                               "one at a time: shut the other down first (llm.llm_engine.core.executor.shutdown())")
        self._procs: list[_Proc] = []
        self._failed: WorkerFailure | None = None
        self._closed = False
        self.driver = Worker(config, rank=0)
        t0 = time.perf_counter()
        self._listener = Listener(self._host())
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._listener, self.driver)
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks ready in %.1f s", world, time.perf_counter() - t0)

    # ---- start-up ---------------------------------------------------------------------------------------

    # ---- what a backend decides (executor/ray_executor.py overrides these) -----------------------------

    def _check_devices(self, config: WorkerConfig) -> None:
        """This machine must have a GPU per rank (CUDA)."""
        check_tensor_parallel_devices(config.device_type, self.world_size)

    def _host(self) -> str:
        """The address rank 0 listens on and hosts torch.distributed's store at."""
        return "127.0.0.1"

    def _launch(self, config: WorkerConfig) -> None:
        """Start ranks 1..N-1; each connects back to the listener."""
        env = dict(os.environ)
        env[AUTHKEY_ENV] = self._listener.authkey.hex()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        host, port = self._listener.address
        for rank in range(1, self.world_size):
            popen = subprocess.Popen([sys.executable, "-m", "pagedllm.executor.worker_proc", host, str(port), str(rank)],
                                     env=env, stdin=subprocess.DEVNULL)
            self._procs.append(_Proc(rank, popen))

    def _bindings(self, config: WorkerConfig) -> list[cpu_binding.CpuBinding | None]:
        """Each rank's cores (all ranks on this machine's CPU), or None (GPUs)."""
        cores = cpu_binding.available_cores() if config.device_type == "cpu" else []
        return [cpu_binding.rank_binding(r, self.world_size, cores, config.num_threads) if cores else None
                for r in range(self.world_size)]

    def _start(self, config: WorkerConfig) -> None:
        self._launch(config)
        self._accept_all()
        bindings = self._bindings(config)
        init_method = f"tcp://{self._host()}:{free_port(self._host())}"
        for p in self._procs:
            p.conn.send(("config", config, init_method, bindings[p.rank]))
        if bindings[0] is not None:
            self.driver.bind_cpu(bindings[0])
        self._wait_all("started", "start")
        self.driver.init_distributed(init_method)
        self.driver.load_model()  # while the workers load theirs
        self._wait_all("loaded", "load its weights")

    def _accept_all(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = {p.rank: p for p in self._procs}
        while pending:
            for p in pending.values():
                if p.popen.poll() is not None:
                    raise WorkerFailure(f"{p.describe()} before it connected to rank 0")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"tensor-parallel workers {sorted(p.rank for p in pending.values())} did not "
                                    f"connect within {START_TIMEOUT_S:.0f} s")
            conn = self._listener.accept(0.2)
            if conn is None:
                continue
            kind, rank, pid = conn.recv()
            proc = pending.pop(rank, None)
            if kind != "hello" or proc is None or (proc.pid is not None and proc.pid != pid):
                conn.close()
                raise WorkerFailure(f"unexpected connection to rank 0 ({kind!r}, rank {rank}, pid {pid})")
            proc.pid, proc.conn = pid, conn

    def _wait_all(self, expected: str, stage: str, timeout_s: float = START_TIMEOUT_S) -> list[tuple]:
        """Every worker's next message, which must be `expected`; a worker's error or death, or the
        deadline, is a WorkerFailure naming it."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple] = {}
        while len(replies) < len(self._procs):
            waiting = [p for p in self._procs if p.rank not in replies]
            ready = wait([p.conn for p in waiting], timeout=0.2)
            for p in waiting:
                if p.conn in ready:
                    msg = self._recv(p)
                    if msg[0] != expected:
                        raise WorkerFailure(f"{p.describe()} sent {msg[0]!r} while rank 0 waited for it to {stage}")
                    replies[p.rank] = msg
                elif p.popen.poll() is not None:
                    raise WorkerFailure(f"{p.describe()} failed to {stage}")
            if time.monotonic() > deadline:
                late = sorted(p.rank for p in self._procs if p.rank not in replies)
                raise WorkerFailure(f"tensor-parallel workers {late} did not {stage} within {timeout_s:.0f} s")
        return [replies[p.rank] for p in self._procs]

    def _recv(self, p: _Proc) -> tuple:
        try:
            msg = p.conn.recv()
        except (EOFError, OSError):
            _wait_quietly(p, 5)
            raise WorkerFailure(f"{p.describe()}: its link to rank 0 closed") from None
        if msg[0] == "error":
            p.error = msg[2]
            _wait_quietly(p, 5)
            raise WorkerFailure(p.describe())
        return msg

    # ---- running ----------------------------------------------------------------------------------------

    def initialize_cache(self, num_blocks, num_host_blocks, max_model_len, compile_batch_sizes=None) -> None:
        if compile_batch_sizes:
            raise ValueError("compile_batch_sizes (compiled decode graphs) is not supported with "
                             "tensor_parallel_size > 1")
        self._broadcast(pickle.dumps(("init_cache", num_blocks, num_host_blocks, max_model_len, None)))
        self._guarded(self.driver.initialize_cache, num_blocks, num_host_blocks, max_model_len, None)
        self._guarded(self._wait_all, "cache_ready", "allocate its KV cache")

    def execute_model(self, plan: StepPlan) -> ModelRunnerOutput:
        self._check_alive()
        self._broadcast(pickle.dumps(("step", encode_for_workers(plan)), protocol=pickle.HIGHEST_PROTOCOL))
        return self._guarded(self.driver.execute_model, plan)

    def profile_memory(self, num_tokens: int, num_seqs: int, max_model_len: int) -> MemoryProfile:
        self._broadcast(pickle.dumps(("profile", num_tokens, num_seqs, max_model_len)))
        mine = self._guarded(self.driver.profile_memory, num_tokens, num_seqs, max_model_len)
        replies = self._guarded(self._wait_all, "profiled", "run the profile forward")
        return MemoryProfile.worst([mine] + [r[2] for r in replies])

    def _broadcast(self, payload: bytes) -> None:
        self._check_alive()
        for p in self._procs:
            try:
                p.conn.send_bytes(payload)
            except OSError:
                self._fail(f"{p.describe()}: rank 0 could not send it the step")

    def _guarded(self, fn, *args):
        """Run `fn` (rank 0's part, which waits on the workers through collectives); a failure
        while a worker is down or has sent an error becomes that worker's WorkerFailure."""
        try:
            return fn(*args)
        except WorkerFailure as e:
            self._failed = e
            raise
        except Exception as e:
            failure = self._find_failure(grace_s=2.0)
            if failure is None:
                raise
            self._failed = WorkerFailure(f"{failure}\n(rank 0 saw: {type(e).__name__}: {e})")
            raise self._failed from e

    def _find_failure(self, grace_s: float) -> str | None:
        """The first worker that died or reported an error, waiting up to `grace_s` for one to show."""
        deadline = time.monotonic() + grace_s
        while True:
            for p in self._procs:
                if p.conn is not None and p.error is None and p.conn.poll(0):
                    try:
                        msg = p.conn.recv()
                        if msg[0] == "error":
                            p.error = msg[2]
                    except (EOFError, OSError):
                        pass
                if p.error is not None or p.popen.poll() is not None:
                    if p.error is None:
                        _wait_quietly(p, 0.5)
                    return f"{p.describe()} during a step" if p.error is None else p.describe()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel executor is shut down")
        if self._failed is not None:
            raise self._failed
        for p in self._procs:
            if p.popen.poll() is not None:
                self._fail(f"{p.describe()} before a step")

    def _fail(self, text: str) -> None:
        failure = self._find_failure(grace_s=0.5)
        self._failed = WorkerFailure(failure or text)
        raise self._failed

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        self._closed = True
        self._finalizer()


def _wait_quietly(p: _Proc, timeout_s: float) -> None:
    """Give a failing worker a moment to exit (so its exit code can be shown)."""
    try:
        p.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _stop_workers(procs: list[_Proc], listener: Listener, driver: Worker) -> None:
    """Ask every worker to stop, then terminate / kill what is left; rank 0 leaves the group and
    gets its cores back. Idempotent (weakref.finalize runs it once)."""
    for p in procs:
        if p.conn is not None and p.popen.poll() is None:
            try:
                p.conn.send_bytes(pickle.dumps(("shutdown",)))
            except OSError:
                pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.terminate()
            try:
                p.popen.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        if p.conn is not None:
            p.conn.close()
    listener.close()
    driver.close()
