"""Run the `tritonserver` bundled in `nvidia-pytriton` on a model repository, on loopback only.

PyTriton ships Triton 2.51 with only the Python backend, and it pins numpy and protobuf, so it
lives in a virtual environment of its own (`FLASHNORM_PYTRITON_VENV`). Three things make its
server run a generated Python-backend model outside PyTriton:

- a backend directory `python/` holding `libtriton_python.so`, `triton_python_backend_utils.py`
  and the stub built for that venv's Python version (PyTriton keeps stubs per version aside);
- `LD_LIBRARY_PATH` with PyTriton's bundled libraries and the directory of the venv Python's
  `libpython` (the stub links `libpython3.X.so`; a pyenv Python keeps it in its own `lib/`);
- the venv's `bin/` first on `PATH`. The stub's embedded interpreter ignores `PYTHONPATH`, but
  it locates itself by finding `python3` on `PATH`; finding the venv's `python3` makes it read
  the venv's `pyvenv.cfg`, so it imports numpy and onnxruntime from the venv's site-packages.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from flashnorm.errors import FlashNormError

_PROBE = """
import importlib.util, json, pathlib, sys, sysconfig
spec = importlib.util.find_spec("pytriton")
package = pathlib.Path(spec.submodule_search_locations[0]) if spec else None
print(json.dumps({
    "pytriton": str(package) if package else None,
    "python_version": f"{sys.version_info[0]}.{sys.version_info[1]}",
    "libdir": sysconfig.get_config_var("LIBDIR") or "",
}))
"""


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class BundledTritonServer:
    """A `tritonserver` process from a PyTriton venv serving a model repository, bound to
    127.0.0.1 on free ports.

    Use as a context manager: entering starts it and waits (bounded) until it is ready;
    leaving stops it (SIGINT, then SIGKILL after `stop_timeout` seconds).
    """

    def __init__(
        self,
        venv: str | os.PathLike[str],
        model_repository: str | os.PathLike[str],
        *,
        ready_timeout: float = 180.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self.venv = Path(venv)
        self.model_repository = Path(model_repository).resolve()
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.http_port = self.grpc_port = 0
        self.process: subprocess.Popen | None = None
        self._workdir: Path | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log_path(self) -> Path:
        assert self._workdir is not None, "server not started"
        return self._workdir / "tritonserver.log"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self._workdir else ""

    def _probe_venv(self) -> dict:
        python = self.venv / "bin" / "python"
        if not python.exists():
            raise FlashNormError(f"PyTriton venv {self.venv} has no bin/python")
        result = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise FlashNormError(f"{python} failed to report its layout: {result.stderr.strip()[-300:]}")
        layout = json.loads(result.stdout)
        if not layout["pytriton"]:
            raise FlashNormError(f"nvidia-pytriton is not installed in {self.venv}")
        return layout

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The exact command line and environment; builds the backend directory."""
        assert self._workdir is not None
        layout = self._probe_venv()
        bundle = Path(layout["pytriton"]) / "tritonserver"
        stub = bundle / "python_backend_stubs" / layout["python_version"] / "triton_python_backend_stub"
        if not stub.exists():
            raise FlashNormError(f"PyTriton has no Python-backend stub for Python {layout['python_version']}")
        backend = self._workdir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for item in (bundle / "backends" / "python").iterdir():
            if item.is_file():
                shutil.copy2(item, backend / item.name)
        shutil.copy2(stub, backend / stub.name)
        libraries = [str(Path(layout["pytriton"]).parent / "nvidia_pytriton.libs"), layout["libdir"]]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [p for p in libraries + [env.get("LD_LIBRARY_PATH", "")] if p]
        )
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        command = [
            str(bundle / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self._workdir / 'backends'}",
            "--http-address=127.0.0.1", f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            "--allow-metrics=false",
            "--exit-timeout-secs=10",
        ]
        return command, env

    def start(self) -> "BundledTritonServer":
        self._workdir = Path(tempfile.mkdtemp(prefix="flashnorm-tritonserver-"))
        self.http_port, self.grpc_port = _free_loopback_port(), _free_loopback_port()
        command, env = self.command()
        with open(self.log_path, "wb") as log:
            # A new session so that stop() can signal the server and its stub processes together.
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        # No proxy: a proxy from the environment must never see a loopback health check.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise FlashNormError(
                    f"tritonserver exited with {self.process.returncode} before becoming ready:\n"
                    + self.log_text()[-4000:]
                )
            if self.is_ready():
                return
            time.sleep(0.5)
        raise FlashNormError(
            f"tritonserver not ready after {self.ready_timeout:.0f} s:\n" + self.log_text()[-4000:]
        )

    def stop(self) -> int | None:
        """Stop the server (SIGINT, then SIGKILL to its process group); returns its exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=self.stop_timeout)
        # Any stub left behind by a killed server belongs to the same process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode

    def cleanup(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "BundledTritonServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.cleanup()
