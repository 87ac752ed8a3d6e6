"""A Spark standalone cluster of separate processes, and Spark applications run as programs.

``StandaloneCluster`` starts a master and two workers (one core, 1 GB each) with the
pip-installed PySpark's ``spark-class``, each a process (and session) of its own, and stops
them by process id: a worker is stopped with SIGTERM first, which stops its executors, then
SIGKILL; any executor JVM still running for one of this cluster's workers is SIGKILLed by pid.

``run_app`` starts ``tests/spark/cluster_app.py`` (the driver: Python and the JVM it starts)
in a session of its own, so a test can SIGKILL the whole application with ``kill_app``.
Executors are found through /proc: ``CoarseGrainedExecutorBackend`` JVMs whose
``--driver-url`` names the application's driver port, so nothing of another run is touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from reference_broker.pair import free_ports

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).with_name("cluster_app.py")
EXECUTOR_CLASS = "CoarseGrainedExecutorBackend"
# Every JVM of these tests (master, workers, drivers, executors) lives for seconds to
# minutes on 2 shared cores, where starting it dominates: the client compiler alone and
# the serial collector leave the cores to the work instead of the JIT's and GC's threads.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["SPARK_HOME"] = str(spark_home())
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("SPARK_CONF_DIR", None)
    env["SPARK_DAEMON_JAVA_OPTS"] = QUICK_JVM
    return env


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def executor_pids(driver_port: int) -> list[int]:
    """The executor JVMs of the application whose driver listens on ``driver_port``."""
    marker = f"CoarseGrainedScheduler@127.0.0.1:{driver_port}"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            args = cmdline(int(entry.name))
            if any(EXECUTOR_CLASS in a for a in args) and any(marker in a for a in args):
                found.append(int(entry.name))
    return sorted(found)


def executor_of(pid: int) -> int | None:
    """The executor JVM a Python worker process descends from."""
    current: int | None = pid
    for _ in range(10):
        if current is None or current <= 1:
            return None
        if any(EXECUTOR_CLASS in a for a in cmdline(current)):
            return current
        current = parent(current)
    return None


def _stop(process: subprocess.Popen[bytes], grace: float) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait(10)


class StandaloneCluster:
    """A master and two one-core workers on 127.0.0.1, started with spark-class."""

    def __init__(self, directory: Path, workers: int = 2) -> None:
        self.directory = directory
        self.workers = workers
        master_port, master_ui, *worker_ports = free_ports(2 + 2 * workers)
        self.master_port = master_port
        self.master_url = f"spark://127.0.0.1:{master_port}"
        self._master_ui = master_ui
        self._worker_ports = worker_ports
        self.processes: list[subprocess.Popen[bytes]] = []

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = _environment()
        env["SPARK_WORKER_DIR"] = str(self.directory / f"{name}-work")
        env["SPARK_LOCAL_DIRS"] = str(self.directory / f"{name}-local")
        log = (self.directory / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.processes.append(process)
        return process

    def start(self, timeout: float = 90.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.master_port),
            "--webui-port",
            str(self._master_ui),
        )
        for number in range(self.workers):
            port, ui = self._worker_ports[2 * number : 2 * number + 2]
            self._spawn(
                f"worker{number}",
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(ui),
                "--cores",
                "1",
                "--memory",
                "1g",
                self.master_url,
            )
        deadline = time.monotonic() + timeout
        log = self.directory / "master.log"
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            if text.count("Registering worker") >= self.workers:
                return
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a cluster process exited: {self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not register in {timeout}s: {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.directory.glob("*.log"))
        )

    def stop(self) -> None:
        for process in reversed(self.processes):  # workers first: they stop their executors
            _stop(process, grace=15.0)
        marker = "spark://Worker@127.0.0.1:"
        ports = {str(p) for p in self._worker_ports}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                args = cmdline(int(entry.name))
                if any(EXECUTOR_CLASS in a for a in args) and any(
                    marker in a and a.rpartition(":")[2] in ports for a in args
                ):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry.name), signal.SIGKILL)


class App:
    """One run of cluster_app.py: the driver program, its JVM, and where it writes."""

    def __init__(self, args: Sequence[str], log: Path) -> None:
        self.driver_port = free_ports(1)[0]
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(APP), "--driver-port", str(self.driver_port), *args],
                env=_environment(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def executors(self) -> list[int]:
        return executor_pids(self.driver_port)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the application ran over {timeout}s: {self.output()}") from None

    def kill(self) -> None:
        """SIGKILL the driver's Python and JVM (its whole process group) at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]
