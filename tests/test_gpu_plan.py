"""The GPU measurement plan of issue 14 (benchmarks/gpu): its matrix, and run.sh end to end
at CPU toy sizes, so that the first session with a GPU meets no surprises.

The end-to-end run takes the float32 records and the matrix-product ceiling (three step
programs to compile on XLA:CPU, about half a minute); the whole toy plan, bf16 and torch
included, runs from a shell with `bash benchmarks/gpu/run.sh --toy OUT`.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # several processes or whole runs: not in the fast loop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "benchmarks", "gpu", "run.sh")
ONLY = "fp32,matmul"


def _plan():
    spec = importlib.util.spec_from_file_location(
        "gpu_plan", os.path.join(REPO, "benchmarks", "gpu", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_matrix_covers_the_issue_and_fits_one_device_call():
    plan = _plan()
    records = plan.matrix()
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))
    train = [r for r in records if r["kind"] == "train"]
    jax = [r for r in train if r["backend"] == "jax"]
    assert {(r["backend"], r["engine"]) for r in train} == {
        ("jax", "ours"), ("jax", "plain"), ("torch", "ours"), ("torch", "plain")}
    assert {r["precision"] for r in jax} == {r["precision"] for r in train} == {
        "float32", "mixed_bfloat16"}
    assert {r["steps_per_execution"] for r in jax} == {1, 8, 32}
    assert {r["steps_per_execution"] for r in train if r["backend"] == "torch"} == {1}
    batches = {r["plan_batch"] for r in train}
    assert 64 in batches and max(batches) >= 1024
    assert {"resident", "host"} <= {r["placement"] for r in jax if r["engine"] == "ours"}
    assert {r["augment"] for r in jax} == {True, False}
    base = next(r for r in records if r["factor"].startswith("base"))
    assert (base["backend"], base["engine"], base["precision"], base["plan_batch"],
            base["steps_per_execution"], base["augment"]) == ("jax", "ours", "float32", 64, 1,
                                                               True)
    by_id = {r["id"]: r for r in records}
    paired = [r for r in train if r["pair"]]
    assert {(r["backend"], r["precision"]) for r in paired} == {
        (b, p) for b in ("jax", "torch") for p in ("float32", "mixed_bfloat16")}
    for r in paired:  # ours against plain Keras on the same workload
        plain = by_id[r["pair"]]
        assert (r["engine"], plain["engine"]) == ("ours", "plain")
        for key in ("backend", "precision", "plan_batch", "steps_per_execution", "augment"):
            assert r[key] == plain[key], (r["id"], key)
    sized = plan.sized(records, plan.GPU_SIZES, toy=False)
    for r in sized:
        if r["kind"] == "train":
            assert r["steps"] % r["steps_per_execution"] == 0
            assert r["steps"] * r["batch"] <= plan.GPU_SIZES["samples"] == 50_000
    groups = {r["backend"] for r in records}
    planned = sum(r["budget_s"] for r in records) + plan.GROUP_START_S * len(groups)
    # One device call: under 10 minutes with the wheels' install and the report.
    assert planned <= plan.GPU_SIZES["budget"] <= 510
    # The larger batches run only when --only names them; they too fit the data.
    beyond = [r for r in plan.sized(plan.matrix(beyond=True), plan.GPU_SIZES, toy=False)
              if r["id"] not in by_id]
    assert {r["plan_batch"] for r in beyond} == {4096, 8192}
    for r in beyond:
        assert r["steps"] * r["batch"] <= plan.GPU_SIZES["samples"]
        assert r["steps"] % r["steps_per_execution"] == 0


def test_peak_table_and_selection():
    plan = _plan()
    assert plan.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert plan.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert plan.peak_bf16_tflops("NVIDIA H200") == 989.4
    assert plan.peak_bf16_tflops(None) is None
    chosen = plan.select(plan.matrix(("jax",)), ONLY)
    assert {r["precision"] for r in chosen if r["kind"] == "train"} == {"float32"}
    assert any(r["kind"] == "matmul" for r in chosen)


def test_no_script_shadows_a_standard_module():
    # A script's folder comes first on its sys.path: benchmarks/gpu/profile.py once made
    # torch's `import cProfile` find it instead of the standard `profile`, on the GPU.
    folders = [os.path.join(REPO, "benchmarks", "gpu"), os.path.join(REPO, "benchmarks"),
               os.path.join(REPO, "scripts")]
    names = {os.path.splitext(name)[0] for folder in folders if os.path.isdir(folder)
             for name in os.listdir(folder) if name.endswith(".py")}
    assert not names & set(sys.stdlib_module_names)


def test_breakdown_sorts_kernels_by_kind():
    spec = importlib.util.spec_from_file_location(
        "gpu_breakdown", os.path.join(REPO, "benchmarks", "gpu", "breakdown.py"))
    breakdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breakdown)

    def kernel(hlo_op, name, dur, ts):
        return {"ph": "X", "pid": 1, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_op": hlo_op}}

    # Names as an H200's trace gave them (2026-11-28): the command buffer, not the fusion,
    # is the HLO op of XLA's own kernels; cuDNN's carry the convolution's.
    events = [
        kernel("cudnn-conv-bias-activation.81",
               "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", 600, 0),
        kernel("cudnn-conv-bw-filter.21", "sm80_xmma_wgrad_implicit_gemm_indexed_bf16", 400,
               600),
        kernel("command_buffer_442", "input_convert_reduce_fusion_8", 300, 1000),
        kernel("command_buffer_442", "loop_reduce_window_fusion", 100, 1300),
        kernel("command_buffer_65", "loop_maximum_fusion", 100, 1400),
        kernel("command_buffer_95", "loop_convert_fusion", 100, 1500),
        kernel("dot.3", "nvjet_sm90_tst_64x384", 200, 1600),
    ]
    assert [breakdown.kind_of(e) for e in events] == [
        "convolution", "convolution", "reduction", "pooling", "elementwise", "elementwise",
        "matmul"]
    # 2 steps, 1.2 TFLOP each: 1.2 ms of convolutions and matrix products per step.
    out = breakdown.breakdown(events, 2, 1.2e12, 1000.0)
    assert out["ms_per_step_by_kind"] == pytest.approx(
        {"convolution": 0.5, "reduction": 0.15, "pooling": 0.05, "elementwise": 0.1,
         "matmul": 0.1})
    assert out["device_busy_ms_per_step"] == pytest.approx(0.9)
    assert out["device_span_ms_per_step"] == pytest.approx(0.9)
    assert out["convolution_tflops"] == pytest.approx(2000.0)
    assert out["busy_peak_fraction"] == pytest.approx(1.2e12 / 0.9e-3 / 1e12 / 1000)


def test_toy_plan_runs_end_to_end(tmp_path):
    out = tmp_path / "plan"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_PLAN_TOY")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", RUN, "--toy", "--backends", "jax", "--only", ONLY, str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "log.txt", "machine.json", "plan.png", "projection.json", "results.json", "summary.txt"]

    machine = json.loads((out / "machine.json").read_text())
    assert machine["mode"] == "toy"
    assert machine["bf16_peak_tflops"] is None  # no datasheet peak on a CPU
    for key in ("date", "python", "cpu_count", "driver", "cuda_driver", "gpu_name", "source"):
        assert key in machine
    assert {"jax", "jaxlib", "keras", "numpy"} <= set(machine["versions"])
    assert _positive(machine["measured_bf16_matmul_tflops"])

    results = json.loads((out / "results.json").read_text())
    plan = _plan()
    expected = [r["id"] for r in plan.select(plan.matrix(("jax",)), ONLY)]
    assert [r["id"] for r in results["records"]] == expected
    for r in results["records"]:
        assert r["status"] == "ok", (r["id"], r.get("reason"))
        assert "ratio_ours_over_plain" in r
        if r["kind"] == "matmul":
            assert _positive(r["tflops"])
            continue
        for key in ("seconds_per_50k_epoch", "images_per_second", "ms_per_step",
                    "achieved_tflops", "train_gflop_per_image", "speedup_over_titan_x",
                    "measured_matmul_fraction", "trainable_parameters"):
            assert _positive(r[key]), (r["id"], key, r[key])
        assert r["peak_fraction"] is None
        assert math.isclose(r["seconds_per_50k_epoch"] * r["images_per_second"], 50_000)
        assert math.isclose(r["images_per_second"] * r["ms_per_step"] / 1000, r["batch"])
        assert r["timed_epochs"] >= 1 and r["timed_steps_per_epoch"] % r[
            "steps_per_execution"] == 0
        if r["pair"]:
            assert _positive(r["ratio_ours_over_plain"])
        else:
            assert r["ratio_ours_over_plain"] is None
    assert any(r["pair"] for r in results["records"])

    projection = json.loads((out / "projection.json").read_text())
    assert set(projection) == {"fastest", "post_batch"}
    for p in projection.values():
        rows = p["projection"]["rows"]
        assert {row["devices"] for row in rows} >= {2, 4, 8}
        assert any("NVLink" in row["link"] for row in rows)
        assert any("PCIe" in row["link"] for row in rows)
        assert all(0 < row["efficiency"] <= row["efficiency_overlap"] <= 1 for row in rows)
        assert p["command"].startswith("keras-multigpu bench --project --step-ms ")
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.txt").read_text()
    assert all(rid in summary for rid in expected)
