"""The GPU side of the peer harness's measurements, through NVML only (no CUDA context in a runner's
process): which GPU a runner's systems use, its name, and a sampler of its utilization and of each
process's memory over a run."""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import threading
import time

__all__ = ["GpuSampler", "device_name", "nvml_index", "process_label"]


class GpuSampler:
    """NVML, every 0.1 s in a thread: utilization and device memory in use (all processes)."""

    def __init__(self) -> None:
        self.util: list[tuple[float, float]] = []
        self.used_gib: list[tuple[float, float]] = []
        self.process_peak_gib: dict[str, float] = {}
        """Each GPU process's largest use over the run (NVML), by :func:`process_label`."""
        self.at_peak: dict[str, float] = {}
        """The processes' use in the process sample taken when the device's total was highest."""
        self._labels: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(nvml_index())
        except Exception:  # CPU checks of the harness: nothing to sample
            self._nvml = None

    def _run(self) -> None:
        best = 0.0
        for tick in itertools.count():
            if self._stop.wait(0.1):
                break
            t = time.perf_counter()
            self.util.append((t, self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0))
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**30
            self.used_gib.append((t, used))
            if tick % 5 == 0 or used > best:  # processes every 0.5 s, and at every new peak of the total
                self._sample_processes(at_peak=used > best)
                best = max(best, used)

    def _sample_processes(self, at_peak: bool) -> None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # noqa: BLE001 - a driver that lists no processes: totals only
            return
        now: dict[str, float] = {}
        for p in procs:
            if p.pid not in self._labels:
                self._labels[p.pid] = process_label(p.pid)
            label = self._labels[p.pid]
            now[label] = now.get(label, 0.0) + (p.usedGpuMemory or 0) / 2**30
        for label, gib in now.items():
            self.process_peak_gib[label] = max(gib, self.process_peak_gib.get(label, 0.0))
        if at_peak:
            self.at_peak = now

    def start(self) -> GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def busy(self, since: float = 0.0) -> float | None:
        kept = [u for t, u in self.util if t >= since]
        return statistics.fmean(kept) if kept else None

    def peak_gib(self) -> float | None:
        return max((u for _, u in self.used_gib), default=None)

    def processes(self) -> dict[str, dict[str, float]]:
        """What :class:`Result` keeps in ``extra["gpu_processes_gib"]``: each process's peak and
        the split of the device's highest total among processes."""
        return {"peak": {k: round(v, 3) for k, v in sorted(self.process_peak_gib.items())},
                "at_device_peak": {k: round(v, 3) for k, v in sorted(self.at_peak.items())}}


def process_label(pid: int) -> str:
    """A process's name for the memory table: its command line's first words (Ray and vLLM set
    titles such as ``ray::MegatronLearnerActor`` and ``VLLM::EngineCore``), and its pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().replace(b"\0", b" ").decode(errors="replace").split()
    except OSError:  # gone, or another pid namespace (a container): the pid alone
        return f"pid {pid}"
    if not words:
        return f"pid {pid}"
    head = words[0] if words[0].startswith(("ray::", "VLLM")) else " ".join(
        [os.path.basename(words[0]), *[w for w in words[1:3] if not w.startswith("-")]])
    return f"{head[:60]} ({pid})"


def _nvml_gpu_count() -> int:
    """GPUs NVML sees (0 without NVML): asks the driver without making a CUDA context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - no NVML: no GPU to speak of
        return 0


def nvml_index(visible: str | None = None) -> int:
    """NVML's number of the GPU the runner's systems use (CUDA's device 0): the first entry of
    ``CUDA_VISIBLE_DEVICES`` (``visible``; NVML numbers every GPU of the host whatever it says), an
    index or a ``GPU-...`` UUID; 0 where it is unset. On a host of several GPUs device.sh gives each
    queue one GPU this way (``GPU=1``), and the sampler must watch that GPU, not GPU 0 where another
    queue's run may be. CUDA and NVML agree on the order where CUDA_DEVICE_ORDER is PCI_BUS_ID and, for
    GPUs of one model (CUDA's default order ranks by speed, then bus), without it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
    first = visible.split(",")[0].strip()
    if not first:
        return 0
    if first.isdigit():
        return int(first)
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            if (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).startswith(first):
                return i
    except Exception:  # noqa: BLE001 - no NVML: nothing to look the UUID up in
        return 0
    raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r}: no GPU of this host has the UUID {first!r}")


def device_name() -> str:
    """The GPU's name (through NVML: no CUDA context in the runner's process), else the CPU."""
    try:
        import pynvml

        if _nvml_gpu_count() > 0:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(nvml_index()))
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no NVML: the CPU below
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
