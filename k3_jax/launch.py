"""Run one program as N JAX processes on this machine: the local stand-in for a multi-host pod or cluster.

    python -m k3_jax.launch --processes 4 --devices-per-process 2 -- train.py --mesh fsdp=2,expert=4
    python -m k3_jax.launch --processes 2 -- -m k3_jax.some_module --flag

Starts ``--processes`` copies of ``python <program...>`` with the ``jax.distributed`` environment that
``sharding.mesh.initialize_distributed`` (called by ``train.py``) reads: ``JAX_COORDINATOR_ADDRESS`` =
127.0.0.1 and a free port (process 0 hosts the coordinator), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``.
On ``--platform cpu`` (the default) each process gets ``--devices-per-process`` virtual CPU devices
(``--xla_force_host_platform_device_count``) and gloo CPU collectives, so cross-process all-reduces,
all-to-alls and gathers run for real; ``--platform gpu`` gives process ``i`` GPUs
``i·D … i·D+D-1`` (``CUDA_VISIBLE_DEVICES``). Every process compiles its own executables (with the
persistent compilation cache on, process 0 writes it and later runs of any process read it).

Output: every line of every process is forwarded as ``[p<i>] line``. Failure: when a process exits
non-zero or is killed, the launcher says which and how, sends SIGTERM to the others, SIGKILL after
``--grace-s`` seconds, and exits with that process's code (128 + signal number for a signal). SIGINT /
SIGTERM to the launcher are passed on to all processes (``train.py`` saves a checkpoint and exits).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

PREFIX = "k3_jax.launch:"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _with_device_count(xla_flags: str, count: int) -> str:
    kept = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def process_env(base: dict[str, str], *, process_id: int, num_processes: int, coordinator: str,
                platform: str, devices_per_process: int | None) -> dict[str, str]:
    """The environment of process ``process_id``: ``base`` plus the distributed and device variables."""
    env = dict(base)
    env.update({"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(num_processes),
                "JAX_PROCESS_ID": str(process_id), "PYTHONUNBUFFERED": "1"})
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
        env["XLA_FLAGS"] = _with_device_count(env.get("XLA_FLAGS", ""), devices_per_process or 1)
    elif platform == "gpu":
        env["JAX_PLATFORMS"] = "cuda"
        if devices_per_process:
            first = process_id * devices_per_process
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(devices_per_process))
    else:
        raise ValueError(f"--platform must be 'cpu' or 'gpu', got {platform!r}")
    return env


def describe_exit(code: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"`` for a ``Popen.returncode``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _forward(stream, prefix: str, out, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def launch(program: Sequence[str], *, processes: int, devices_per_process: int | None = None,
           platform: str = "cpu", grace_s: float = 10.0, out=None, err=None) -> int:
    """Run ``python *program`` as ``processes`` JAX processes; returns the exit code (0: all succeeded).

    When one process fails, the others are stopped (SIGTERM, then SIGKILL after ``grace_s``) and the failing
    process's code is returned (128 + signal number if it was killed by a signal).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    if not program:
        raise ValueError("no program given (python -m k3_jax.launch --processes N -- train.py ...)")
    coordinator = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    width = len(str(processes - 1))
    for i in range(processes):
        env = process_env(dict(os.environ), process_id=i, num_processes=processes, coordinator=coordinator,
                          platform=platform, devices_per_process=devices_per_process)
        p = subprocess.Popen([sys.executable, *program], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_forward, args=(p.stdout, f"[p{i:0{width}d}] ", out, lock), daemon=True)
        t.start()
        threads.append(t)
    with lock:
        err.write(f"{PREFIX} {processes} processes x {devices_per_process or 'all'} {platform} devices, "
                  f"coordinator {coordinator}, pids {' '.join(str(p.pid) for p in procs)}\n")
        err.flush()

    def pass_on(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    failed: int | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c is not None and c != 0]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        if failed is not None:
            others = [i for i, p in enumerate(procs) if p.poll() is None]
            with lock:
                err.write(f"{PREFIX} process {failed} (pid {procs[failed].pid}) "
                          f"{describe_exit(procs[failed].returncode)}; stopping the other "
                          f"{len(others)} running process(es) {others}\n")
                err.flush()
            _stop(procs, others, grace_s, err, lock)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for t in threads:
            t.join(timeout=5)
    if failed is None:
        return 0
    code = procs[failed].returncode
    return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen], which: list[int], grace_s: float, err, lock) -> None:
    for i in which:
        if procs[i].poll() is None:
            procs[i].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for i in which:
        try:
            procs[i].wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[i].kill()
            procs[i].wait()
            with lock:
                err.write(f"{PREFIX} process {i} (pid {procs[i].pid}) did not stop within {grace_s:g} s "
                          "of SIGTERM; killed it\n")
                err.flush()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, program = argv[:cut], argv[cut + 1:]
    else:
        own, program = argv, []
    ap = argparse.ArgumentParser(prog="python -m k3_jax.launch", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__,
                                 usage="%(prog)s --processes N [options] -- PROGRAM [ARGS...]")
    ap.add_argument("--processes", type=int, required=True, help="number of JAX processes")
    ap.add_argument("--devices-per-process", type=int, default=None,
                    help="CPU: virtual devices per process (default 1); GPU: GPUs per process (default all)")
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--grace-s", type=float, default=10.0,
                    help="seconds between SIGTERM and SIGKILL when stopping the others after a failure")
    args = ap.parse_args(own)
    if not program:
        ap.error("no program: put it after '--', e.g. -- train.py --mesh fsdp=-1")
    return launch(program, processes=args.processes, devices_per_process=args.devices_per_process,
                  platform=args.platform, grace_s=args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
