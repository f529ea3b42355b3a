"""NVML (nvidia-ml-py): what each GPU is, and how busy it is while training runs.

NVML, unlike a framework, creates no CUDA context and allocates no device
memory, so asking it is free of side effects. `gpu_report()` is what
`keras-multigpu devices` prints; `Sampler` is the thread `DeviceMonitor`
runs: each GPU's utilisation and memory, and, through NVML's GPM counters on
Hopper and later, the share of SMs that were busy, which "utilisation"
overstates (one kernel on one SM counts as 100%).

Every NVML call is guarded on its own (`field`): a field one GPU, driver or
pynvml version lacks is None, and hides nothing else.
"""

import os
import threading
import time


def visible_indices(count):
    """NVML indices that CUDA_VISIBLE_DEVICES leaves visible, in its order."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(count))
    indices = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit():
            # UUIDs or MIG names: NVML order cannot be matched cheaply, and
            # a wrong guess is worse than reporting all of them.
            return list(range(count)) if item else indices
        if int(item) < count:
            indices.append(int(item))
    return indices


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here: no library, no driver, or no permission."""


def open_nvml():
    """Returns pynvml, initialised; the caller must `nvmlShutdown()` it."""
    try:
        import pynvml
    except ImportError as error:
        raise NvmlUnavailable(
            f"nvidia-ml-py is not installed ({error}); pip install \"keras-multigpu[monitor]\" "
            "brings it") from error
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise NvmlUnavailable(str(error) or type(error).__name__) from error
    return pynvml


def field(nvml, name, *args):
    """`nvml.<name>(*args)`, or None where this GPU, driver or pynvml lacks it.

    One missing field (power on a laptop GPU, NVLink on a PCIe card) must not
    hide the others, hence a guard per field.
    """
    function = getattr(nvml, name, None)
    if function is None:
        return None
    try:
        return function(*args)
    except nvml.NVMLError:
        return None


def _nvlink(nvml, handle):
    """Per-link state (True: active) up to the first link NVML refuses; None without NVLink."""
    links = []
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = field(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            break
        links.append(bool(state))
    return links or None


# Per-direction bandwidth one NVLink link carries, by NVLink version (NVIDIA's figures:
# P100 20 GB/s, V100/A100/H100 25 GB/s); PCIe per lane per direction, by generation
# (theoretical), of which about 78% is reached (as bench.scaling assumes: 50 of 64 GB/s).
NVLINK_LINK_BYTES = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 50e9}
PCIE_LANE_BYTES = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
PCIE_ACHIEVED = 0.78


def link(nvml, handle):
    """`(name, bytes/s per direction, seconds per hop)` of the link this GPU talks over.

    NVLink where links are up (their count times one link's bandwidth), else
    its current PCIe link; None when NVML reports neither.
    """
    links = _nvlink(nvml, handle) or []
    if any(links):
        version = field(nvml, "nvmlDeviceGetNvLinkVersion", handle, links.index(True)) or 4
        up = sum(links)
        return f"NVLink {version} x{up}", up * NVLINK_LINK_BYTES.get(version, 25e9), 5e-6
    generation = field(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)
    width = field(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)
    if generation in PCIE_LANE_BYTES and width:
        return (f"PCIe Gen{generation} x{width}",
                PCIE_ACHIEVED * PCIE_LANE_BYTES[generation] * width, 10e-6)
    return None


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _gpu_facts(nvml, visible_id, handle):
    name = field(nvml, "nvmlDeviceGetName", handle)
    memory = field(nvml, "nvmlDeviceGetMemoryInfo", handle)
    rates = field(nvml, "nvmlDeviceGetUtilizationRates", handle)
    power = field(nvml, "nvmlDeviceGetPowerUsage", handle)  # milliwatts
    return {
        "id": visible_id,
        "name": _text(name),
        "memory_used_bytes": None if memory is None else int(memory.used),
        "memory_total_bytes": None if memory is None else int(memory.total),
        "utilization_gpu": None if rates is None else int(rates.gpu),
        "temperature_c": field(nvml, "nvmlDeviceGetTemperature", handle,
                                getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
        "power_w": None if power is None else power / 1000.0,
        "pcie_generation": field(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
        "pcie_width": field(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle),
        "nvlink": _nvlink(nvml, handle),
    }


def gpu_report():
    """What NVML says about each visible GPU, without touching device memory.

    Returns:
        `{"nvml": "ok" | "unavailable: <reason>", "gpus": [...]}`, one dict
        per GPU that `CUDA_VISIBLE_DEVICES` leaves visible (ids renumbered
        from 0, as the frameworks do) with `name`, `memory_used_bytes`,
        `memory_total_bytes`, `utilization_gpu` (%), `temperature_c`,
        `power_w`, `pcie_generation`, `pcie_width` and `nvlink` (a list of
        per-link states); a field NVML cannot give is None.
    """
    try:
        nvml = open_nvml()
    except NvmlUnavailable as error:
        return {"nvml": f"unavailable: {error}", "gpus": []}
    try:
        count = nvml.nvmlDeviceGetCount()
        gpus = []
        for visible_id, index in enumerate(visible_indices(count)):
            handle = field(nvml, "nvmlDeviceGetHandleByIndex", index)
            if handle is not None:
                gpus.append(_gpu_facts(nvml, visible_id, handle))
        return {"nvml": "ok", "gpus": gpus}
    except nvml.NVMLError as error:
        return {"nvml": f"unavailable: {error}", "gpus": []}
    finally:
        field(nvml, "nvmlShutdown")


class Gpm:
    """SM activity of one GPU from two GPM samples (NVML's GPM API, Hopper and later).

    GPM metrics are rates between two samples, so each reading swaps the
    newer sample in. Any NVML error turns it off for good: it is optional.
    """

    def __init__(self, nvml, handle):
        self.nvml, self.handle, self.on = nvml, handle, False
        support = field(nvml, "nvmlGpmQueryDeviceSupport", handle)
        if support is None or not getattr(support, "isSupportedDevice", 0):
            return
        try:
            self.samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
            nvml.nvmlGpmSampleGet(handle, self.samples[0])
            self.on = True
        except (nvml.NVMLError, AttributeError):
            pass

    def read(self):
        """`(sm_util, sm_occupancy)` in % since the last read, or `(None, None)`."""
        if not self.on:
            return None, None
        nvml = self.nvml
        try:
            nvml.nvmlGpmSampleGet(self.handle, self.samples[1])
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = 2
            request.sample1, request.sample2 = self.samples
            request.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            request.metrics[1].metricId = nvml.NVML_GPM_METRIC_SM_OCCUPANCY
            nvml.nvmlGpmMetricsGet(request)
            self.samples.reverse()
            return float(request.metrics[0].value), float(request.metrics[1].value)
        except (nvml.NVMLError, AttributeError):
            self.on = False
            return None, None

    def close(self):
        for sample in getattr(self, "samples", []):
            field(self.nvml, "nvmlGpmSampleFree", sample)


class Sampler(threading.Thread):
    """Reads every visible GPU each `interval` seconds into `rows`.

    A daemon thread: NVML calls take microseconds and release the GIL, so
    the training thread hardly notices it.
    """

    def __init__(self, nvml, interval, clock_zero, only=None):
        super().__init__(name="DeviceMonitor", daemon=True)
        self.nvml, self.interval, self.zero = nvml, interval, clock_zero
        indices = visible_indices(nvml.nvmlDeviceGetCount())
        if only is not None:  # the visible GPUs the model trains on (ids as the frameworks')
            indices = [indices[i] for i in only if 0 <= i < len(indices)]
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self.gpm = [Gpm(nvml, h) for h in self.handles]
        self.links = [link(nvml, h) for h in self.handles]
        self.uuids = [_text(field(nvml, "nvmlDeviceGetUUID", h)) for h in self.handles]
        self.rows = []  # (seconds, device, util %, sm activity %, sm occupancy %, memory bytes)
        self.error = None
        self._halt = threading.Event()

    def sample(self):
        now = time.perf_counter() - self.zero
        for device, (handle, gpm) in enumerate(zip(self.handles, self.gpm)):
            rates = field(self.nvml, "nvmlDeviceGetUtilizationRates", handle)
            memory = field(self.nvml, "nvmlDeviceGetMemoryInfo", handle)
            sm_util, occupancy = gpm.read()
            self.rows.append((now, device, None if rates is None else float(rates.gpu),
                              sm_util, occupancy, None if memory is None else int(memory.used)))

    def run(self):
        try:
            self.sample()
            while not self._halt.wait(self.interval):
                self.sample()
        except Exception as error:  # noqa: BLE001 - a broken sampler must not end training
            self.error = error

    def stop(self):
        """Stops sampling; frees NVML's resources once the thread has ended (a thread stuck
        in an NVML call keeps them: freeing them under it could crash the process)."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=max(2.0, 4 * self.interval))
        if self.is_alive():
            self.error = self.error or RuntimeError("an NVML call did not return")
            return
        for gpm in self.gpm:
            gpm.close()
        field(self.nvml, "nvmlShutdown")
