"""The benchmark harness: a tiny real run gives valid JSON and plots; the cost model."""

import importlib.util
import json
import math
import os

import pytest

from keras_multigpu import _xla, bench, cli
from keras_multigpu.bench import harness, report, scaling, setups, worker

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop


def test_setup_names():
    assert bench.parse("ours-4") == bench.Setup("ours", 4)
    assert bench.parse("mirrored-2").backend == "tensorflow"
    assert bench.parse("keras_dp_torch-2").processes == 2  # one process per device
    assert bench.parse("ours_next_torch-2").processes == 2
    for bad in ("ours", "ours-0", "horovod-2", "plain-2", "ours-x"):
        with pytest.raises(ValueError, match=bad):
            bench.parse(bad)
    with pytest.raises(ValueError, match=r"runs on 1 device or more\. Received: 'ours-0'; "
                                         r"pass ours-1"):  # (it said "Unknown setup")
        bench.parse("ours-0")
    assert bench.parse("ours_tf-2").backend == "tensorflow"
    for bad in ("plain_tf-2", "ours_jax-2"):
        with pytest.raises(ValueError, match=bad):
            bench.parse(bad)
    names = [s.name for s in bench.default_setups(3)]
    assert names == ["plain-1", "ours-1", "ours-2", "ours-3", "plain_tf-1", "ours_tf-1",
                     "ours_tf-2", "ours_tf-3", "plain_torch-1", "ours_torch-1", "ours_torch-2",
                     "ours_torch-3", "dataparallel-2", "mirrored-2", "independent-2",
                     "independent_tf-2", "ddp_torch-2", "keras_dp_torch-2", "independent_torch-2",
                     "dataparallel-3", "mirrored-3", "independent-3", "independent_tf-3",
                     "ddp_torch-3", "keras_dp_torch-3", "independent_torch-3"]
    assert bench.parse("ddp_torch-2").backend == "torch"


def test_worker_environment_sets_devices_and_backend():
    env = bench.Setup("dataparallel", 3).environment(
        {"KERAS_MULTIGPU_CPU_DEVICES": "8", "XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
         "--other"}, virtual=True)
    assert env["KERAS_BACKEND"] == "jax" and "KERAS_MULTIGPU_CPU_DEVICES" not in env
    flags = env["XLA_FLAGS"].split()
    assert flags[:2] == ["--other", "--xla_force_host_platform_device_count=3"]
    # Every JAX setup gets the raised collective timeouts ours gets (where jaxlib has them).
    assert env["XLA_FLAGS"] == _xla.virtual_device_flags(3, "--other")
    assert bench.Setup("mirrored", 2).environment({}, virtual=True)["KERAS_BACKEND"] == "tensorflow"


def test_next_keras_setups_run_on_the_next_keras():
    """keras_dp_torch and its own references, plain Keras and the ceiling on the next Keras,
    put the folder NEXT_KERAS_ENV names first on their path; ours and the others do not."""
    base = {setups.NEXT_KERAS_ENV: "/next", "PYTHONPATH": "/mine"}
    ceiling = bench.parse("independent_next_torch-2")
    assert ceiling.processes == 2 and ceiling.worker == bench.Setup("plain_next_torch", 1)
    for name in ("keras_dp_torch-2", "ours_next_torch-2", "plain_next_torch-1",
                 "independent_next_torch-2"):
        env = bench.parse(name).worker.environment(base, virtual=True)
        assert env["PYTHONPATH"] == os.pathsep.join(["/next", "/mine"]), name
        assert env["KERAS_BACKEND"] == "torch"
    for name in ("ours_torch-2", "plain_torch-1", "ddp_torch-2"):
        assert bench.parse(name).environment(base, virtual=True)["PYTHONPATH"] == "/mine"
    table = {name: {"images_per_second": {"median": speed}} for name, speed in (
        ("plain_torch-1", 100.0), ("plain_next_torch-1", 110.0),
        ("keras_dp_torch-2", 180.0), ("ours_next_torch-2", 171.0),
        ("independent_next_torch-2", 200.0))}
    for name, row in table.items():
        row.update(engine=bench.parse(name).engine, devices=bench.parse(name).devices)
    assert harness._ratios(table, "images_per_second") == {
        "plain_next_torch-1 / plain_torch-1": 1.1,
        "ours_next_torch-2 / keras_dp_torch-2": 0.95,
        "ours_next_torch-2 / independent_next_torch-2": 0.855,
        "keras_dp_torch-2 / independent_next_torch-2": 0.9}


def test_tensorflow_setups_get_their_devices():
    ours = bench.Setup("ours_tf", 3).environment({"KERAS_MULTIGPU_CPU_DEVICES": "8"}, virtual=True)
    assert ours["KERAS_BACKEND"] == "tensorflow" and ours["KERAS_MULTIGPU_CPU_DEVICES"] == "3"
    assert "KERAS_MULTIGPU_CPU_DEVICES" not in bench.Setup("ours_tf", 3).environment(
        {"KERAS_MULTIGPU_CPU_DEVICES": "8"}, virtual=False)
    ceiling = bench.parse("independent_tf-2")
    assert ceiling.processes == 2 and ceiling.worker == bench.Setup("plain_tf", 1)
    assert ceiling.environment({}, virtual=True)["KERAS_BACKEND"] == "tensorflow"


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="the TensorFlow setups need TensorFlow, which is not installed")
def test_tiny_tensorflow_run(tmp_path):
    # The independent ceiling's processes are the JAX run's (below), on plain_tf-1 workers
    # (test_tensorflow_setups_get_their_devices); its two TensorFlow starts are left out.
    code = cli.main(["bench", "--setups", "plain_tf-1,ours_tf-1,ours_tf-2,mirrored-2",
                     "--model", "dense", "--samples", "256", "--epochs", "2",
                     "--rounds", "1", "--batch-per-device", "32", "--output", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["table"]) == {"plain_tf-1", "ours_tf-1", "ours_tf-2", "mirrored-2"}
    assert results["raw"]["ours_tf-2"][0]["global_batch"] == 64
    assert {"ours_tf-1 / plain_tf-1", "ours_tf-2 / ours_tf-1", "ours_tf-2 / mirrored-2"} <= set(
        results["ratios"])
    # Collectives traced into each step: ours all-reduces the gradients and the logs (this
    # model has no BatchNormalization, whose statistics would add theirs), MirroredStrategy
    # its gradients; one device has none.
    table = results["table"]
    assert table["ours_tf-2"]["collectives_per_step"]["median"] >= 2
    assert table["mirrored-2"]["collectives_per_step"]["median"] >= 1
    assert table["ours_tf-2"]["collective_kb_per_step"]["median"] > 0
    assert table["plain_tf-1"]["collectives_per_step"]["median"] == 0


def test_torch_setups_run_one_process_per_device():
    ours = bench.parse("ours_torch-3")
    assert ours.processes == 3 and ours.worker == ours
    env = ours.environment({"KERAS_MULTIGPU_CPU_DEVICES": "8"}, virtual=True, process=2,
                           port=1234)
    assert env["KERAS_BACKEND"] == "torch" and "KERAS_MULTIGPU_CPU_DEVICES" not in env
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == (
        "2", "3", "2", "1234")
    ceiling = bench.parse("independent_torch-2")
    assert ceiling.worker == bench.Setup("plain_torch", 1) and "RANK" not in (
        ceiling.environment({}, virtual=True, process=1))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="the PyTorch setups need torch, which is not installed")
def test_tiny_torch_run(tmp_path):
    """Ours and the torch peers; the next Keras's DataParallel runs where
    KERAS_MULTIGPU_NEXT_KERAS names it (scripts/test.sh does), else it says what it needs."""
    # The independent ceiling's processes are the JAX run's, on plain_torch-1 workers
    # (test_torch_setups_run_one_process_per_device); its two torch starts are left out.
    code = cli.main(["bench", "--setups", "plain_torch-1,ours_torch-1,ours_torch-2,ddp_torch-2,"
                     "keras_dp_torch-2", "--model", "dense", "--samples",
                     "256", "--epochs", "2", "--rounds", "1", "--batch-per-device", "32",
                     "--fit-calls", "1", "--output", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    ran = {"plain_torch-1", "ours_torch-1", "ours_torch-2", "ddp_torch-2"}
    if os.environ.get(setups.NEXT_KERAS_ENV):
        ran.add("keras_dp_torch-2")
        assert "ours_torch-2 / keras_dp_torch-2" in results["ratios"]
    else:
        assert "needs the next Keras" in results["skipped"]["keras_dp_torch-2"]
    assert set(results["table"]) == ran
    raw = results["raw"]["ours_torch-2"][0]
    assert raw["global_batch"] == 64 and len(raw["processes"]) == 2
    assert {"ours_torch-1 / plain_torch-1", "ours_torch-2 / ours_torch-1",
            "ours_torch-2 / ddp_torch-2"} <= set(results["ratios"])
    # Collectives per step, where a process group runs: ours (the gradients' bucket and the
    # logs, at least) and DDP's buckets; none for plain Keras.
    table = results["table"]
    assert table["ours_torch-2"]["collectives_per_step"]["median"] >= 2
    assert table["ddp_torch-2"]["collectives_per_step"]["median"] >= 1
    assert table["ours_torch-2"]["collective_kb_per_step"]["median"] > 0
    assert table["plain_torch-1"]["collectives_per_step"] is None
    # Rank 0's verdict, from every process's figures.
    assert any(v.startswith("ours_torch-2: ") and "input-bound: data " in v
               for v in results["verdicts"])


def test_independent_setup_is_one_device_processes():
    ceiling = bench.parse("independent-3")
    assert ceiling.processes == 3 and ceiling.worker == bench.Setup("plain", 1)
    virtual = ceiling.environment({}, virtual=True, process=2)
    assert virtual["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    assert "CUDA_VISIBLE_DEVICES" not in virtual
    assert ceiling.environment({}, virtual=False, process=2)["CUDA_VISIBLE_DEVICES"] == "2"
    visible = {"CUDA_VISIBLE_DEVICES": "4,5,7"}  # the user's choice of GPUs is kept
    assert ceiling.environment(visible, virtual=False, process=2)["CUDA_VISIBLE_DEVICES"] == "7"
    with pytest.raises(ValueError, match="needs 3 GPUs; CUDA_VISIBLE_DEVICES shows 2"):
        ceiling.environment({"CUDA_VISIBLE_DEVICES": "0,1"}, virtual=False, process=0)
    assert bench.parse("ours-3").processes == 1


def test_tiny_run_writes_results_and_plots(tmp_path, capsys):
    code = cli.main(["bench", "--setups",
                     "plain-1,ours-1,ours-2,dataparallel-2,independent-2",
                     "--model", "dense", "--samples", "256", "--epochs", "2", "--rounds", "1",
                     "--batch-per-device", "32", "--output", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    # (TensorFlow's setups, mirrored-2 among them: test_tiny_tensorflow_run.)
    assert set(results["table"]) == {"plain-1", "ours-1", "ours-2", "dataparallel-2",
                                     "independent-2"}
    for name, row in results["table"].items():
        assert row["images_per_second"]["median"] > 0, name
        step = row["ms_per_step"]
        assert step["min"] <= step["median"] <= step["max"]
    two = results["table"]["ours-2"]
    assert two["devices"] == 2 and two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert two["compiled_step_ms"]["median"] > 0  # the step alone, on placed data
    # Collectives in the compiled step (XLA's optimised HLO): one device runs none; two run
    # the gradients' all-reduce, which XLA combines with the logs' for this small model.
    table = results["table"]
    assert table["plain-1"]["collectives_per_step"]["median"] == 0
    assert table["ours-1"]["collectives_per_step"]["median"] == 0
    gradients_kib = 4 * (32 * 32 * 3 * 64 + 64 + 64 * 10 + 10) / 1024
    for name in ("ours-2", "dataparallel-2"):
        assert table[name]["collectives_per_step"]["median"] >= 1, name
        assert table[name]["collective_kb_per_step"]["median"] >= gradients_kib, name
    assert results["raw"]["ours-2"][0]["global_batch"] == 64
    ceiling = results["raw"]["independent-2"][0]  # two plain-1 processes at once, summed
    assert [p["global_batch"] for p in ceiling["processes"]] == [32, 32]
    assert ceiling["images_per_second"] == pytest.approx(
        sum(p["images_per_second"] for p in ceiling["processes"]))
    assert {"ours-1 / plain-1", "ours-2 / ours-1", "ours-2 / dataparallel-2",
            "ours-2 / independent-2"} <= set(results["ratios"])
    assert results["projection"]["rows"] and results["machine"]["cores"] >= 1
    # Whole fit calls after the warm-up fit: every setup has the per-call figures.
    assert results["spec"]["fit_calls"] == 3 and results["spec"]["fit_epochs"] == 1
    for name, row in results["table"].items():
        for figure in ("fit_call_ms", "fit_call_images_per_second"):
            spread = row[figure]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"] < math.inf, (name, figure)
        assert math.isfinite(row["fit_call_outside_epochs_ms"]["median"]), name
    for name in ("plain-1", "ours-1", "ours-2", "dataparallel-2"):
        calls = results["raw"][name][0]["fit_calls"]
        assert len(calls) == 3 and all(c["seconds"] >= c["epoch_seconds"] > 0 for c in calls)
        assert all(isinstance(c["compiles"], int) for c in calls), name  # counted on JAX
    for name in ("ours-1", "ours-2"):  # a warm model compiles nothing more per fit call
        assert results["table"][name]["fit_call_compiles"]["max"] == 0, name
    assert ceiling["fit_call_images_per_second"] == pytest.approx(
        sum(p["fit_call_images_per_second"] for p in ceiling["processes"]))
    assert {"ours-1 / plain-1", "ours-2 / dataparallel-2"} <= set(results["fit_call_ratios"])
    assert all(v > 0 for v in results["fit_call_ratios"].values())
    printed = capsys.readouterr().out
    assert "ours-2 / dataparallel-2" in printed and "Projected efficiency" in printed
    assert "Whole fit calls after a warm-up fit" in printed and "Per fit call:" in printed
    # The verdict: DeviceMonitor in every worker; ours's data time measured, plain's not.
    verdicts = results["verdicts"]
    assert "Verdict (DeviceMonitor in each worker" in printed and verdicts[0] in printed
    assert any(v.startswith("ours-2: ") and "input-bound: data " in v for v in verdicts)
    assert any(v.startswith("plain-1: ") and "data wait not measured" in v for v in verdicts)
    assert any(v.startswith("ours-2: ") and "virtual CPU devices share" in v for v in verdicts)


def _row(engine, devices, ms):
    return {"engine": engine, "devices": devices, "ms_per_step": {"median": ms}}


@pytest.mark.parametrize("ms, found", [(40.0, "communication-bound (measured)"),
                                       (11.0, "not communication-bound (measured)")])
def test_scaling_verdict_on_gpus_is_the_steps_growth(ms, found):
    from keras_multigpu.bench import harness

    table = {"ours-1": _row("ours", 1, 10.0), "ours-4": _row("ours", 4, ms)}
    lines = harness.verdicts(table, {"ours-1": [{}], "ours-4": [{}]}, virtual=False)
    assert len(lines) == 1 and lines[0].startswith(f"ours-4: {found}")
    share = round(100 * (1 - 10.0 / ms))
    assert f"{ms:.1f} ms per step against 10.0 ms on one device" in lines[0]
    assert f"{share}% of the step is the all-reduce" in lines[0]


def test_fit_call_figures_are_medians_over_calls():
    calls = [{"seconds": s, "epoch_seconds": s - 0.01, "compiles": c}
             for s, c in ((0.5, 0), (0.25, 1), (1.0, 0))]
    figures = worker.fit_call_figures(calls, samples=100, epochs=2)
    assert figures["fit_call_ms"] == pytest.approx(500)
    assert figures["fit_call_images_per_second"] == pytest.approx(400)
    assert figures["fit_call_outside_epochs_ms"] == pytest.approx(10)
    assert figures["fit_call_compiles"] == 1
    assert worker.fit_call_figures([], samples=100, epochs=2)["fit_call_ms"] is None


def test_cost_model_behaves():
    rows = scaling.project(2e-3, 6.6e6, counts=(2, 4, 8, 16))
    nvlink = [r for r in rows if r["link"].startswith("NVLink")]
    pcie4 = [r for r in rows if r["link"] == "PCIe Gen4 x16"]
    assert [r["devices"] for r in nvlink] == [2, 4, 8, 16]
    efficiencies = [r["efficiency"] for r in pcie4]
    assert efficiencies == sorted(efficiencies, reverse=True)  # more GPUs, more exposed comm
    for fast, slow in zip(nvlink, pcie4):
        assert fast["efficiency"] > slow["efficiency"]
        assert fast["efficiency_overlap"] >= fast["efficiency"]
    assert scaling.allreduce_seconds(1e9, 1, 1e9, 1e-5) == 0.0


# The several-hosts cost model: 2 hosts x 2 GPUs, 1 GB of gradients, 100 GB/s and
# 1 us inside a host, a 10 GB/s NIC and 10 us between hosts.
INSIDE, NETWORK = (100e9, 1e-6), (10e9, 1e-5)


def test_allreduce_formulas_by_hand():
    # Flat ring: 2 (N - 1) = 6 steps of 1 GB / 4 over the slowest hop, each paying the
    # slowest latency: 6 * (25 ms + 10 us).
    assert scaling.flat_ring_seconds(1e9, 2, 2, INSIDE, NETWORK) == pytest.approx(0.15006)
    # Hierarchical, one NIC per GPU: reduce-scatter 1/2 GB / 100 GB/s + 1 us, the same
    # for the all-gather; across hosts each GPU all-reduces its 500 MB over 2 hosts:
    # 2 * 1/2 * 500 MB / 10 GB/s + 2 * 10 us.
    assert scaling.hierarchical_seconds(1e9, 2, 2, INSIDE, NETWORK, "gpu") == pytest.approx(
        2 * (0.005 + 1e-6) + (0.05 + 2e-5))
    # One NIC per host: its two GPUs share the 10 GB/s, the middle phase doubles.
    assert scaling.hierarchical_seconds(1e9, 2, 2, INSIDE, NETWORK, "node") == pytest.approx(
        2 * (0.005 + 1e-6) + (0.1 + 2e-5))
    with pytest.raises(ValueError, match="nic"):
        scaling.hierarchical_seconds(1e9, 2, 2, INSIDE, NETWORK, "rack")
    # Efficiencies of a 100 ms step: flat 0.15 s, all exposed: 0.1 / 0.25; with
    # overlap 0.15 - 2/3 * 0.1 is exposed. Hierarchical 0.06 s hides entirely.
    (row,) = scaling.project_hosts(0.1, 1e9, hosts=(2,), gpus_per_host=2,
                                   clusters={"x": (INSIDE, NETWORK, "gpu")})
    assert (row["hosts"], row["gpus"], row["nic"]) == (2, 4, "gpu")
    assert row["efficiency_flat"] == pytest.approx(0.1 / (0.1 + 0.15006))
    assert row["efficiency_flat_overlap"] == pytest.approx(0.1 / (0.1 + 0.15006 - 0.2 / 3))
    assert row["efficiency_hierarchical"] == pytest.approx(0.1 / (0.1 + 0.060022))
    assert row["efficiency_hierarchical_overlap"] == 1.0
    assert scaling.step_for_efficiency(0.01, 0.9) == pytest.approx(0.09)


def test_scaling_with_one_host_is_the_single_host_ring():
    for link in scaling.LINKS.values():
        for gpus in (1, 2, 8):
            ring = scaling.allreduce_seconds(6.6e6, gpus, *link)
            for network in scaling.NETWORKS.values():
                for nic in ("gpu", "node"):
                    assert scaling.flat_ring_seconds(6.6e6, 1, gpus, link, network) == ring
                    assert scaling.hierarchical_seconds(
                        6.6e6, 1, gpus, link, network, nic) == pytest.approx(ring, abs=1e-15)
    # and the H = 1 rows of the several-hosts table are the single-host table's rows
    single = {(r["link"], r["devices"]): r for r in scaling.project(2e-3, 6.6e6, counts=(8,))}
    for row in scaling.project_hosts(2e-3, 6.6e6, hosts=(1,), gpus_per_host=8):
        link = scaling.CLUSTERS[row["cluster"]][0]
        assert row["efficiency_flat"] == pytest.approx(single[link, 8]["efficiency"])
        assert row["efficiency_hierarchical_overlap"] == pytest.approx(
            single[link, 8]["efficiency_overlap"])
    # One GPU per host: both are a ring over the network.
    net = scaling.NETWORKS["100 GbE"]
    ring = scaling.allreduce_seconds(1e8, 4, *net)
    assert scaling.flat_ring_seconds(1e8, 4, 1, INSIDE, net) == pytest.approx(ring)
    assert scaling.hierarchical_seconds(1e8, 4, 1, INSIDE, net, "gpu") == pytest.approx(ring)


def test_hierarchical_allreduce_wins_when_the_network_is_slower():
    nvlink = scaling.LINKS["NVLink 4 (H100 SXM)"]
    for network in scaling.NETWORKS.values():
        for hosts in (2, 4, 16, 64):
            for gpus in (2, 4, 8):
                for grad_bytes in (1e5, 6.6e6, 1.78e8, 1e9):
                    flat = scaling.flat_ring_seconds(grad_bytes, hosts, gpus, nvlink, network)
                    hier = scaling.hierarchical_seconds(grad_bytes, hosts, gpus, nvlink,
                                                        network, "gpu")
                    assert hier <= flat, (network, hosts, gpus, grad_bytes)
    # With one NIC per host the NIC carries about 2 S either way: large gradients over
    # slow PCIe inside the host make the hierarchical scheme the slower (as documented).
    pcie3, ethernet = scaling.OTHER_LINKS["PCIe Gen3 x16"], scaling.NETWORKS["25 GbE"]
    assert scaling.hierarchical_seconds(1.78e8, 16, 8, pcie3, ethernet, "node") > (
        scaling.flat_ring_seconds(1.78e8, 16, 8, pcie3, ethernet))
    # More hosts, less efficiency; a faster network, more.
    rows = scaling.project_hosts(5e-3, 1.78e8, hosts=(1, 2, 4, 16, 64))
    for cluster in scaling.CLUSTERS:
        effs = [r["efficiency_hierarchical"] for r in rows if r["cluster"] == cluster]
        assert effs == sorted(effs, reverse=True), cluster
    by = {(r["cluster"], r["hosts"]): r for r in rows}
    assert (by["NVLink 4 + IB NDR, NIC per GPU", 16]["hierarchical_ms"]
            < by["NVLink 4 + IB HDR, NIC per GPU", 16]["hierarchical_ms"]
            < by["NVLink 4 + 100 GbE, NIC per node", 16]["hierarchical_ms"])


def test_scaling_beside_horovods_published_figures():
    published = scaling.HOROVOD_PUBLISHED
    assert "1802.05799" in published["source"] and "benchmarks" in published["source"]
    assert published["efficiency"][("ResNet-101", 512)] == 0.90
    assert published["efficiency"][("VGG-16", 512)] == 0.68
    comparison = scaling.horovod_comparison()
    assert comparison["grad_bytes"] == pytest.approx(4 * 44.5e6)
    assert "assumed" in comparison["step_assumption"]
    shapes = [(r["hosts"], r["gpus_per_host"]) for r in comparison["rows"]]
    assert {(32, 4), (128, 4), (16, 8), (64, 8)} <= set(shapes)
    for row in comparison["rows"]:
        assert row["published_resnet101"] == {128: 0.88, 512: 0.90}[row["gpus"]]
        if row["cluster"].startswith("PCIe Gen3"):  # Horovod's hardware: the published
            # figure lies between our no-overlap and full-overlap figures
            assert row["efficiency_flat"] < row["published_resnet101"] <= (
                row["efficiency_flat_overlap"])
    json.dumps(comparison)  # goes into projection.json as it is


def test_project_from_step_ms_trains_nothing(tmp_path, capsys, monkeypatch):
    from keras_multigpu.bench import harness

    def no_worker(*args, **kwargs):
        raise AssertionError("--project --step-ms must not run a worker")

    monkeypatch.setattr(harness, "run_worker", no_worker)
    code = cli.main(["bench", "--project", "--step-ms", "10", "--model", "dense",
                     "--hosts", "1,2,16", "--gpus-per-host", "4", "--output", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "projection.json").read_text())
    assert results["measured"] is None and "modelled" in results["note"]
    p = results["projection"]
    assert p["compute_ms"] == 10 and p["source"] == "--step-ms"
    assert p["parameters"] == 197322 and p["grad_bytes"] == 4 * 197322  # the dense model's
    assert [(r["hosts"], r["gpus"]) for r in p["multi_host"]["rows"]][:3] == [
        (1, 4), (2, 8), (16, 64)]
    assert len(p["multi_host"]["rows"]) == 3 * len(scaling.CLUSTERS)
    assert p["rows"] and p["horovod"]["rows"]
    printed = capsys.readouterr().out
    for text in ("Projected efficiency from --step-ms", "Several hosts, 4 GPUs each",
                 "flat ms", "hier ms", "Beside Horovod", "projection.json"):
        assert text in printed, text
    assert not (tmp_path / "results.json").exists()
    # --params replaces the model's count (no model is built)
    code = cli.main(["bench", "--project", "--step-ms", "40", "--params", "44.5e6",
                     "--output", str(tmp_path)])
    assert code == 0
    p = json.loads((tmp_path / "projection.json").read_text())["projection"]
    assert p["parameters"] == 44_500_000 and p["multi_host"]["hosts"] == [1, 2, 4, 16, 64]


def test_project_flags_are_checked(tmp_path, capsys):
    assert cli.main(["bench", "--project", "--setups", "ours-1", "--step-ms", "10",
                     "--output", str(tmp_path / "x")]) == 2
    assert "--project runs no setups" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    for flags in (["--hosts", "0,2"], ["--hosts", "2,2"], ["--hosts", "two"],
                  ["--gpus-per-host", "0"], ["--params", "1.5"], ["--params", "-3"]):
        with pytest.raises(SystemExit) as stop:
            cli.main(["bench", "--project", "--step-ms", "10", *flags])
        assert stop.value.code == 2, flags
        assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--setups", ""], "--setups names no setup. Received: --setups ''"),
    (["--setups", " , "], "--setups names no setup"),
    (["--setups", "plain-1,ours-2,plain-1"], "--setups names plain-1 more than once"),
    (["--output", "{file}"], "is a file; choose another --output"),
])
def test_bench_refuses_no_setups_repeated_ones_and_a_file_for_output(flags, message, tmp_path,
                                                                      capsys):
    """Before: an empty --setups ran the default setups, a repeated one ran twice per round,
    and an --output that is a file failed with "[Errno 17] File exists" after the setups
    were chosen."""
    afile = tmp_path / "results.txt"
    afile.write_text("")
    flags = [f.format(file=afile) for f in flags]
    output = [] if "--output" in flags else ["--output", str(tmp_path / "x")]
    assert cli.main(["bench", "--rounds", "1", *output, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_project_measures_ours_1_once(tmp_path, capsys):
    code = cli.main(["bench", "--project", "--model", "dense", "--batch-per-device", "32",
                     "--samples", "1024", "--hosts", "1,4", "--output", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "projection.json").read_text())
    measured, p = results["measured"], results["projection"]
    assert measured["setup"] == "ours-1" and measured["steps_per_epoch"] == 8  # at most 8
    assert results["spec"]["epochs"] == 1 and results["spec"]["fit_calls"] == 0
    assert p["compute_ms"] == measured["compiled_step_ms"] > 0
    assert p["source"] == "measured ours-1 compiled step" and p["parameters"] == 197322
    assert results["machine"]["devices"]
    assert "Projected efficiency from measured ours-1 compiled step" in capsys.readouterr().out


def test_a_bench_that_measured_nothing_says_why_and_exits_1(tmp_path, capsys):
    """Every setup failed (each round past --timeout): exit status 1, not 0, and the row
    keeps the end of the reason ("timed out after ..."), which the first 150 characters of
    the command line it failed with had cut off."""
    code = cli.main(["bench", "--setups", "ours-1", "--model", "dense", "--samples", "64",
                     "--epochs", "1", "--rounds", "1", "--timeout", "1",
                     "--output", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    row = next(line for line in out.splitlines() if line.startswith("ours-1"))
    assert "failed in 1 round(s)" in row and row.endswith("timed out after 1.0 seconds"), row
    assert "no setup was measured" in err
    assert json.loads((tmp_path / "results.json").read_text())["table"] == {}


def test_the_table_shows_no_efficiency_without_a_one_device_base():
    row = {"devices": 2, "images_per_second": {"median": 10.0, "min": 9.0, "max": 11.0},
           **{k: None for k in report.FIGURES if k != "images_per_second"}}
    table = bench.format_table({"table": {"ours-2": row}, "skipped": {}, "ratios": {},
                                "projection": None})
    assert table.splitlines()[1].split()[-1] == "-"  # it printed 1.00
