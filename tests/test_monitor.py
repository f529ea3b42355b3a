"""Tests for keras_multigpu.monitor: `devices` through NVML, DeviceMonitor and its verdict.

NVML is faked (a module object put in `sys.modules["pynvml"]`) so that every
path runs on a CPU-only machine: three GPUs, one without GPM, one whose power
and NVLink queries fail. The timing verdicts run real `fit` calls on CPU
with wide margins, since CI machines are small and loaded.
"""

import csv
import json
import sys
import time
import types

import keras
import numpy as np
import pytest

import keras_multigpu as kmg
from keras_multigpu import cli, devices, monitor
from keras_multigpu import nvml as nvml_lib
from keras_multigpu.callbacks import DeviceMonitor


class NVMLError(Exception):
    pass


def fake_nvml(utils=(90, 88, 30), fail_init=False):
    """A pynvml stand-in: GPU 0 full-featured, GPU 1 without GPM, GPU 2 without power/NVLink."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.NVML_NVLINK_MAX_LINKS = 18
    nvml.NVML_GPM_METRICS_GET_VERSION = 1
    nvml.NVML_GPM_METRIC_SM_UTIL, nvml.NVML_GPM_METRIC_SM_OCCUPANCY = 2, 3
    ns = types.SimpleNamespace

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def no_power_on_2(handle, *args):
        if handle == 2:
            raise NVMLError("Not Supported")
        return 250_000

    def nvlink_state(handle, link):
        if handle == 2 or link >= 4:
            raise NVMLError("Not Supported")
        return int(link < 2)

    class MetricsGet:
        def __init__(self):
            self.metrics = [ns(metricId=0, value=0.0) for _ in range(2)]

    def metrics_get(request):
        for metric in request.metrics:
            metric.value = {2: 61.0, 3: 40.0}[metric.metricId]

    nvml.nvmlInit, nvml.nvmlShutdown = init, lambda: None
    nvml.nvmlDeviceGetCount = lambda: 3
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetName = lambda h: f"Fake GPU {h}".encode()
    nvml.nvmlDeviceGetMemoryInfo = lambda h: ns(used=(h + 1) * 2**30, total=80 * 2**30)
    nvml.nvmlDeviceGetUtilizationRates = lambda h: ns(gpu=utils[h], memory=10)
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 40 + h
    nvml.nvmlDeviceGetPowerUsage = no_power_on_2
    nvml.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5
    nvml.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    nvml.nvmlDeviceGetNvLinkState = nvlink_state
    nvml.nvmlGpmQueryDeviceSupport = lambda h: ns(isSupportedDevice=int(h != 1))
    nvml.nvmlGpmSampleAlloc = object
    nvml.nvmlGpmSampleGet = lambda h, sample: sample
    nvml.nvmlGpmSampleFree = lambda sample: None
    nvml.c_nvmlGpmMetricsGet_t = MetricsGet
    nvml.nvmlGpmMetricsGet = metrics_get
    return nvml


@pytest.fixture
def nvml(monkeypatch):
    """Installs a fake pynvml for `gpu_report` and the monitor; `list_devices` (cached, and
    what the engine trains on) keeps seeing the virtual CPU devices."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: [])
    devices.list_devices.cache_clear()
    yield install_fake(monkeypatch)
    devices.list_devices.cache_clear()


def install_fake(monkeypatch):
    def install(**kwargs):
        fake = fake_nvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


# -- keras-multigpu devices ----------------------------------------------------------


def test_devices_json_reports_each_gpu_and_null_for_what_nvml_lacks(nvml, capsys):
    nvml()
    assert cli.main(["devices", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nvml"] == "ok"
    first, _, third = report["gpus"]
    assert first["name"] == "Fake GPU 0" and first["utilization_gpu"] == 90
    assert first["memory_used_bytes"] == 2**30 and first["memory_total_bytes"] == 80 * 2**30
    assert (first["temperature_c"], first["power_w"]) == (40, 250.0)
    assert (first["pcie_generation"], first["pcie_width"]) == (5, 16)
    assert first["nvlink"] == [True, True, False, False]
    assert third["power_w"] is None and third["nvlink"] is None  # errors became nulls
    assert [d["kind"] for d in report["devices"]] == ["cpu"] * 8  # the old listing, kept


def test_devices_without_nvml_says_so_plainly(nvml, capsys):
    nvml(fail_init=True)
    assert cli.main(["devices"]) == 0
    assert "No GPU found (NVML: unavailable: Driver Not Loaded); CPU devices: 8" in (
        capsys.readouterr().out)
    assert cli.main(["devices", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpus"] == [] and report["nvml"].startswith("unavailable: Driver Not Loaded")
    assert report["cpu_devices"] == 8


def test_devices_table_shows_the_nvml_facts(nvml, capsys):
    nvml()
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "gpu:0 Fake GPU 0: memory 1.0/80.0 GiB, util 90%, 40 C, 250 W, PCIe gen 5 x16, " \
           "NVLink 2/4 links up" in out
    assert "gpu:2 Fake GPU 2" in out and "? W" in out and "NVLink none" in out


# -- the sampler and the verdict -------------------------------------------------------


def test_sampler_reads_gpm_where_supported_and_none_elsewhere(nvml):
    sampler = nvml_lib.Sampler(nvml(), 0.5, time.perf_counter())
    sampler.sample()
    sampler.sample()
    by_device = {row[1]: row for row in sampler.rows[-3:]}
    assert by_device[0][2:5] == (90.0, 61.0, 40.0)
    assert by_device[1][3] is None and by_device[1][4] is None  # no GPM on GPU 1
    assert by_device[2][5] == 3 * 2**30
    sampler.stop()


def test_verdict_names_the_lagging_device(nvml):
    sampler = nvml_lib.Sampler(nvml(utils=(92, 90, 40)), 0.5, time.perf_counter())
    for _ in range(3):
        sampler.sample()
    steps = [(i, 0, 0.1, 10.0) for i in range(10)]
    found = monitor.verdict(steps, sampler.rows, "dataset", gpus=3)
    assert found["lagging_device"] == 2 and found["input"] == "no"
    assert any("one device lags: gpu:2 averages 40%" in line for line in found["lines"])
    assert found["communication"] == "not estimated"  # no link given: one device


def test_links_come_from_nvlink_where_up_else_pcie(nvml):
    sampler = nvml_lib.Sampler(nvml(), 0.5, time.perf_counter())
    assert sampler.links[0][0] == "NVLink 4 x2" and sampler.links[0][1] == 50e9
    assert sampler.links[2][0] == "PCIe Gen5 x16"  # its NVLink queries fail
    assert sampler.links[2][1] == pytest.approx(0.78 * 3.938e9 * 16)
    assert sampler.uuids == [None, None, None]  # the fake has no UUIDs
    sampler.stop()


class Replicated:
    """What `communication_estimate` reads of a model: replicas and trainable variables."""

    def __init__(self, replicas, parameters):
        self.num_replicas = replicas
        self.trainable_variables = [keras.Variable(np.zeros(parameters, "float32"))]


@pytest.mark.parametrize("step_ms, bound", [(1.0, "communication"), (100.0, "compute")])
def test_communication_is_estimated_from_the_gradient_and_the_slowest_link(step_ms, bound):
    links = [("NVLink 4 x18", 450e9, 5e-6), ("PCIe Gen4 x16", 25e9, 10e-6)]
    estimate = monitor.communication_estimate(Replicated(4, 25_000_000), links)
    # ring all-reduce of 100 MB over 4 replicas on the slower link: 2 * 3/4 * 100e6 / 25e9 s
    assert estimate["link"] == "PCIe Gen4 x16"
    assert estimate["ms"] == pytest.approx(1000 * (1.5 * 100e6 / 25e9 + 6 * 10e-6))
    assert monitor.communication_estimate(Replicated(1, 10), links) is None  # one device
    assert monitor.communication_estimate(Replicated(4, 10), [None, links[0]]) is None
    steps = [(i, 0, 0.0, step_ms) for i in range(5)]
    found = monitor.verdict(steps, [], "dataset", gpus=0, communication=estimate)
    assert found["bound"] == bound
    assert found["communication"] == ("bound" if bound == "communication" else "not bound")
    assert any(line.startswith("communication (estimated, not measured)")
               for line in found["lines"])


def ranks(*data_ms, step_ms=10.0):
    return [{"rank": r, "host": f"node{r // 2}", "steps": 9, "data_ms": d, "step_ms": step_ms,
             "measured": "dataset"} for r, d in enumerate(data_ms)]


def test_the_slowest_process_sets_the_input_verdict_and_is_named():
    steps = [(i, 0, 0.1, 10.0) for i in range(10)]  # process 0 is quick
    found = monitor.verdict(steps, [], "dataset", ranks=ranks(0.1, 0.2, 4.0, 0.1))
    assert found["input"] == "highly" and found["evidence"]["data_rank"] == 2
    assert found["lagging_rank"] == 2
    assert any("one process lags: rank 2 (node1) takes 4.0 ms" in line
               for line in found["lines"])
    even = monitor.verdict(steps, [], "dataset", ranks=ranks(0.1, 0.2, 0.15, 0.1))
    assert even["input"] == "no" and even["lagging_rank"] is None


def test_every_gpu_joins_the_timeline_once():
    first = {"host": "a", "uuids": ["GPU-0", "GPU-1"], "links": [None, None],
             "timeline": [[0.0, 0, 90.0, None, None, 1], [0.0, 1, 80.0, None, None, 1]]}
    same_host = {**first, "timeline": [[0.5, 0, 10.0, None, None, 1]]}  # GPU-0 again
    other = {"host": "b", "uuids": [None], "links": [["PCIe Gen4 x16", 25e9, 1e-5]],
             "timeline": [[0.2, 0, 70.0, None, None, 1]]}
    timeline, links = monitor._merge_hosts([first, same_host, other])
    assert [(row[1], row[2]) for row in timeline] == [(0, 90.0), (1, 80.0), (2, 70.0)]
    assert links == [None, None, ("PCIe Gen4 x16", 25e9, 1e-5)]


@pytest.mark.parametrize("data_ms, level", [(0.1, "no"), (1.0, "moderately"), (3.0, "highly")])
def test_verdict_thresholds(data_ms, level):
    steps = [(i, 0, data_ms, 10.0) for i in range(5)]
    found = monitor.verdict(steps, [], "dataset", gpus=0)
    assert found["input"] == level
    assert found["bound"] == ("input" if level == "highly" else "compute")


@pytest.mark.parametrize("data_ms", [0.1, 3.0])
def test_a_cpu_run_says_so_whatever_held_it_back(data_ms):
    steps = [(i, 0, data_ms, 10.0) for i in range(5)]
    found = monitor.verdict(steps, [], "dataset", gpus=0, accelerator="cpu")
    assert sum("no GPU: the CPU does the work" in line for line in found["lines"]) == 1


# -- real fits on CPU -------------------------------------------------------------------


def small_model(inputs=8, width=16):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(width, "relu"),
                              keras.layers.Dense(2, activation="softmax")])
    parallel = kmg.multi_gpu_model(model, gpus=1)
    parallel.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return parallel


class SlowBatches(keras.utils.PyDataset):
    def __init__(self, batches=8, delay=0.03, **kwargs):
        super().__init__(**kwargs)
        self.batches, self.delay = batches, delay

    def __len__(self):
        return self.batches

    def __getitem__(self, index):
        time.sleep(self.delay)
        rng = np.random.default_rng(index)
        return rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 2, 16)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_slow_pydataset_is_called_input_bound(tmp_path, nvml):
    nvml(fail_init=True)
    watch = DeviceMonitor(tmp_path / "mon")
    small_model().fit(SlowBatches(), epochs=2, verbose=0, callbacks=[watch])
    assert watch.verdict["input"] == "highly", watch.verdict
    assert watch.verdict["evidence"]["data_ms_per_step"] > 20  # the 30 ms sleep, seen
    steps = read_csv(tmp_path / "mon" / "steps.csv")
    assert len(steps) == 16 and {s["epoch"] for s in steps} == {"0", "1"}
    assert (tmp_path / "mon" / "monitor.png").stat().st_size > 0
    assert read_csv(tmp_path / "mon" / "timeline.csv") == []  # no NVML: no samples


def test_a_pydatasets_workers_are_waited_for_in_the_training_thread(tmp_path, nvml):
    """With worker threads, the step's wait for each batch (from Keras's queue of their
    batches) is what is timed: the input's real cost, not the workers' own time."""
    nvml(fail_init=True)
    watch = DeviceMonitor(tmp_path / "mon")
    small_model().fit(SlowBatches(workers=2), epochs=1, verbose=0, callbacks=[watch])
    assert watch.verdict["evidence"]["data_measured"] == "dataset"
    assert watch.verdict["evidence"]["data_ms_per_step"] > 0


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("plain", [True, False])
def test_tensorboard_receives_the_scalars(tmp_path, nvml, given, plain):
    pytest.importorskip("tensorflow")
    nvml()
    board = keras.callbacks.TensorBoard(tmp_path / "tb")
    # Not given: found among the fit's callbacks, for a plain Keras model too.
    watch = DeviceMonitor(tmp_path / "mon", interval=0.05, tensorboard=board if given else None)
    if plain:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    else:
        model = small_model()
    x = np.zeros((32, 8), "float32")
    model.fit(x, np.zeros(32), batch_size=16, epochs=1, verbose=0, callbacks=[board, watch])
    assert list((tmp_path / "tb" / "devices").glob("events.out.tfevents.*"))


def test_no_tensorboard_no_scalars(tmp_path, nvml):
    nvml()
    watch = DeviceMonitor(tmp_path / "mon", interval=0.05)
    small_model().fit(np.zeros((32, 8), "float32"), np.zeros(32), batch_size=16, epochs=1,
                      verbose=0, callbacks=[watch])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mon"]


def test_resident_arrays_with_real_compute_are_not_highly_input_bound(tmp_path, nvml, capsys):
    nvml(fail_init=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(1024, "relu")
                                                       for _ in range(3)]
                             + [keras.layers.Dense(2, activation="softmax")])
    parallel = kmg.multi_gpu_model(model, gpus=1)
    parallel.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(2048, 256)).astype("float32")
    y = np.random.default_rng(1).integers(0, 2, 2048)
    watch = DeviceMonitor(tmp_path / "mon")
    parallel.fit(x, y, batch_size=256, epochs=2, verbose=0, callbacks=[watch])
    evidence = watch.verdict["evidence"]
    assert evidence["step_ms_per_step"] > 2, evidence  # a step that does real work
    # The batches are gathered on the device: the host only reads each batch's row indices,
    # and the gather's dispatch is not counted, however long it waits for the step before
    # it (XLA:CPU runs a device's work in order).
    assert watch.verdict["input"] == "no", evidence
    assert evidence["data_ms_per_step"] < 0.05 * evidence["step_ms_per_step"], evidence
    out = capsys.readouterr().out
    assert "NVML unavailable (Driver Not Loaded); step timing only" in out
    assert "DeviceMonitor:" in out and "input-bound" in out


def test_arrays_built_on_the_host_time_the_wait_for_each_batch(tmp_path, nvml, monkeypatch):
    from keras_multigpu import parallel

    nvml(fail_init=True)
    monkeypatch.setattr(parallel, "RESIDENT_LIMIT_BYTES", 0)  # arrays stay on the host
    put = parallel.ParallelModel._put

    def slow(self, batch):
        time.sleep(0.03)  # a slow host path: the prefetch cannot hide it
        return put(self, batch)

    monkeypatch.setattr(parallel.ParallelModel, "_put", slow)
    watch = DeviceMonitor(tmp_path / "mon")
    x = np.zeros((128, 8), "float32")
    small_model().fit(x, np.zeros(128), batch_size=16, epochs=1, verbose=0, callbacks=[watch])
    assert watch.verdict["evidence"]["data_measured"] == "dataset"
    assert watch.verdict["evidence"]["data_ms_per_step"] > 15, watch.verdict["evidence"]
    assert watch.verdict["input"] == "highly"


def test_fake_gpus_are_sampled_during_fit(tmp_path, nvml, monkeypatch):
    nvml()
    # As for a model on the three GPUs (the fake NVML's; the engine trains on CPU devices).
    monkeypatch.setattr(DeviceMonitor, "_model_gpus", lambda self: [0, 1, 2])
    watch = DeviceMonitor(tmp_path / "mon", interval=0.05)
    x = np.zeros((64, 8), "float32")
    small_model().fit(x, np.zeros(64), batch_size=16, epochs=1, verbose=0, callbacks=[watch])
    rows = read_csv(tmp_path / "mon" / "timeline.csv")
    assert {r["device"] for r in rows} == {"0", "1", "2"}
    assert {r["sm_activity"] for r in rows if r["device"] == "1"} == {""}
    assert watch.verdict["lagging_device"] == 2


def test_only_the_models_gpus_are_sampled(tmp_path, nvml):
    nvml()
    x = np.zeros((64, 8), "float32")
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    plain.compile(optimizer="sgd", loss="mse")
    watch = DeviceMonitor(tmp_path / "plain", interval=0.05)
    plain.fit(x, np.zeros((64, 2)), batch_size=16, verbose=0, callbacks=[watch])
    assert {r[1] for r in watch.timeline} == {0}  # Keras's first GPU, not the idle others
    assert watch.verdict["lagging_device"] is None
    # A ParallelModel on CPU devices samples no GPU, and says where the work ran.
    watch = DeviceMonitor(tmp_path / "cpu", interval=0.05)
    small_model().fit(x, np.zeros(64), batch_size=16, verbose=0, callbacks=[watch])
    assert watch.timeline == []
    assert any("no GPU: the CPU does the work" in line for line in watch.verdict["lines"])
    sampler = nvml_lib.Sampler(nvml(), 0.5, time.perf_counter(), only=[2, 7])  # 7: not there
    assert sampler.handles == [2]
    sampler.stop()


def test_a_slow_generator_is_input_bound(tmp_path, nvml):
    nvml(fail_init=True)

    def batches():
        rng = np.random.default_rng(0)
        while True:
            time.sleep(0.03)
            yield rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 2, 16)

    watch = DeviceMonitor(tmp_path / "mon")
    small_model().fit(batches(), steps_per_epoch=8, epochs=1, verbose=0, callbacks=[watch])
    assert watch.verdict["evidence"]["data_ms_per_step"] > 20, watch.verdict["evidence"]
    assert watch.verdict["input"] == "highly"


def test_too_few_steps_are_not_judged_and_a_copy_is_a_fresh_monitor(tmp_path, nvml):
    import copy
    import pickle

    nvml(fail_init=True)
    watch = DeviceMonitor(tmp_path / "mon")
    small_model().fit(np.zeros((16, 8), "float32"), np.zeros(16), batch_size=16, verbose=0,
                      callbacks=[watch])
    assert watch.verdict["bound"] == "unclear" and watch.verdict["input"] == "unknown"
    assert watch.verdict["lines"] == ["nothing to judge: 1 step(s) ran, the first of which "
                                      "compiles."]
    twin = copy.deepcopy(watch)  # as KerasTuner copies callbacks for each trial
    assert twin.log_dir == watch.log_dir and twin._sampler is None
    assert pickle.loads(pickle.dumps(DeviceMonitor(tmp_path / "p"))).interval == 0.5


@pytest.mark.parametrize("kwargs, error, match", [
    ({"interval": "fast"}, ValueError, "interval must be a positive number"),
    ({"interval": True}, ValueError, "interval must be a positive number"),
    ({"tensorboard": 123}, TypeError, "tensorboard must be a keras.callbacks.TensorBoard"),
])
def test_bad_arguments_are_refused_at_once(kwargs, error, match):
    with pytest.raises(error, match=match):
        DeviceMonitor("x", **kwargs)


def test_unwritable_log_dir_fails_before_training(tmp_path, nvml):
    nvml(fail_init=True)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    parallel = small_model()
    x = np.zeros((32, 8), "float32")
    with pytest.raises(OSError, match="a-file"):
        parallel.fit(x, np.zeros(32), batch_size=16, epochs=1, verbose=0,
                     callbacks=[DeviceMonitor(blocker / "mon")])
    assert int(keras.ops.convert_to_numpy(parallel.optimizer.iterations)) == 0


def test_plain_keras_model_times_steps_and_says_data_is_not_measured(tmp_path, nvml):
    nvml(fail_init=True)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    watch = DeviceMonitor(tmp_path / "mon")
    model.fit(np.zeros((32, 8)), np.zeros((32, 2)), batch_size=8, epochs=1, verbose=0,
              callbacks=[watch])
    assert watch.verdict["evidence"]["data_measured"] == "none"
    assert watch.verdict["input"] == "unknown"
    assert "data wait not measured" in watch.verdict["lines"][0]
    steps = read_csv(tmp_path / "mon" / "steps.csv")
    assert len(steps) == 4 and {s["data_ms"] for s in steps} == {""}


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        DeviceMonitor("x", interval=0)


def test_one_long_step_is_clipped_from_the_step_plot_and_named():
    from keras_multigpu._monitor_files import _step_axis_top

    steps = [5.0] * 79 + [9300.0] + [5.0] * 80  # the step that compiles evaluation
    top, clipped = _step_axis_top(steps)
    assert clipped == [9300.0]
    assert 15.0 < top < 16.0  # 3 x the 95th percentile (5 ms), with a margin
    assert _step_axis_top([5.0, 6.0, 5.5] * 10) == (None, [])  # nothing stands out
    assert _step_axis_top([5.0, 9300.0]) == (None, [])  # too few steps to judge
