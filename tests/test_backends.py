"""Tests for keras_multigpu.backends: the same names in every backend module."""

import importlib
import os
import warnings

import jax
import keras
import pytest

from keras_multigpu import backends, devices
from keras_multigpu.devices import Device


def test_backend_names():
    assert backends.BACKENDS == ("jax", "tensorflow", "torch")
    assert len(set(backends.API)) == len(backends.API) == 9
    optional = [name for names in backends.CAPABILITY_NAMES.values() for name in names]
    assert len(set(optional)) == len(optional) and not set(optional) & set(backends.API)


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_every_backend_defines_the_api_and_exactly_its_capabilities(name):
    """A capability an engine lacks is data (absent from CAPABILITIES), not a function
    that does nothing; one it has is defined."""
    module = importlib.import_module(f"{backends.__name__}.{name}")
    missing = [api for api in backends.API if not callable(getattr(module, api, None))]
    assert missing == []
    assert module.CAPABILITIES <= set(backends.CAPABILITY_NAMES)
    for capability, names in backends.CAPABILITY_NAMES.items():
        defined = [n for n in names if callable(getattr(module, n, None))]
        assert defined == (list(names) if capability in module.CAPABILITIES else []), capability


def test_an_unknown_capability_is_named():
    with pytest.raises(KeyError, match="No capability 'speed'"):
        backends.has(backends.current(), "speed")


def test_current_is_the_jax_module():
    assert keras.backend.backend() == "jax"
    current = backends.current()
    assert current is importlib.import_module("keras_multigpu.backends.jax")
    assert current is backends.current()


@pytest.fixture
def uncached_current():
    backends.current.cache_clear()
    yield
    backends.current.cache_clear()


def test_current_refuses_an_unknown_keras_backend(monkeypatch, uncached_current):
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    with pytest.raises(ValueError, match=r"Received: KERAS_BACKEND='numpy'") as info:
        backends.current()
    assert "'jax'" in str(info.value)


def test_current_follows_the_keras_backend(monkeypatch, uncached_current):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    assert backends.current() is importlib.import_module("keras_multigpu.backends.torch")


# -- the jax module in this (started) process ------------------------------------------


def test_jax_list_devices_are_the_engine_devices():
    jax_backend = importlib.import_module("keras_multigpu.backends.jax")
    found = jax_backend.list_devices()
    assert len(found) == len(jax.devices()) == 8
    assert all(isinstance(d, Device) for d in found)
    assert [str(d) for d in found] == [f"cpu:{i}" for i in range(8)]


def test_jax_configure_after_start(monkeypatch):
    jax_backend = importlib.import_module("keras_multigpu.backends.jax")
    jax.devices()  # make sure JAX has started
    monkeypatch.setenv("XLA_FLAGS", "--marker")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jax_backend.configure_cpu_devices(8) is True
    monkeypatch.setattr(devices, "_started_with", None)
    with pytest.warns(UserWarning, match=r"already started with 8 CPU device\(s\), so 3"):
        assert jax_backend.configure_cpu_devices(3) is False
    assert os.environ["XLA_FLAGS"] == "--marker"  # too late: nothing rewritten
    assert devices._started_with == 8  # and list_devices lists the 8 it kept
    devices.list_devices.cache_clear()


def test_jax_make_distribution_uses_the_devices_given():
    jax_backend = importlib.import_module("keras_multigpu.backends.jax")
    chosen = [Device(2, "cpu", "virtual CPU"), Device(5, "cpu", "virtual CPU")]
    distribution = jax_backend.make_distribution(chosen)
    devices = distribution.device_mesh.devices.ravel().tolist()
    assert [d.id for d in devices] == [2, 5]


def test_jax_make_distribution_refuses_an_unknown_device():
    jax_backend = importlib.import_module("keras_multigpu.backends.jax")
    with pytest.raises(ValueError, match=r"JAX has no device gpu:0"):
        jax_backend.make_distribution([Device(0, "gpu", "missing")])


def test_jax_process_rank():
    jax_backend = importlib.import_module("keras_multigpu.backends.jax")
    assert jax_backend.process_index() == 0
    assert jax_backend.process_count() == 1


def test_virtual_devices_set_the_collective_timeouts_the_jaxlib_has(monkeypatch):
    from keras_multigpu import _xla

    flags = _xla.virtual_device_flags(2, "--xla_cpu_collective_timeout_seconds=5 --foo=1")
    assert "--xla_force_host_platform_device_count=2" in flags.split()
    assert "--xla_cpu_collective_timeout_seconds=5" in flags.split()  # the user's value stays
    assert "--foo=1" in flags.split()
    # XLA's own end comes after KERAS_MULTIGPU_TIMEOUT (the engine's watchdog speaks first).
    monkeypatch.setenv("KERAS_MULTIGPU_TIMEOUT", "20")
    if _xla.knows("--xla_cpu_collective_call_terminate_timeout_seconds"):
        assert "--xla_cpu_collective_call_terminate_timeout_seconds=80" in (
            _xla.virtual_device_flags(2, "").split())
    one = _xla.virtual_device_flags(1, "")
    assert one == "--xla_force_host_platform_device_count=1"  # one device: no collectives


def test_a_flag_the_jaxlib_lacks_is_never_added(monkeypatch):
    from keras_multigpu import _xla

    monkeypatch.setattr(_xla, "CPU_COLLECTIVE_TIMEOUTS", ("--xla_no_such_flag_in_any_jaxlib",))
    assert not _xla.knows("--xla_no_such_flag_in_any_jaxlib")
    assert "no_such_flag" not in _xla.virtual_device_flags(2, "")


@pytest.mark.parametrize("k", [2, 1, 0])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "rows_inner", "sliced"])
def test_torch_dropout_draws_the_batchs_mask_in_its_inputs_layout(layout, k):
    """torch draws a dropout mask in the memory order of its input (a strided Conv1D's
    output in Keras is a permuted view): a process's ones for the batch's n rows, laid out
    as its k rows are, draw one device's mask for the batch, whose rows [start, start + k)
    are the process's."""
    import torch

    from keras_multigpu.backends._torch_native import _ones

    def made(rows):  # the same op on `rows` rows, as on every process and one device
        base = torch.arange(1.0, 1 + rows * 24).reshape(-1, 4, 6)
        if layout == "permuted":
            return base.permute(0, 2, 1)
        if layout == "rows_inner":
            return base.reshape(4, rows, 6).permute(1, 0, 2)
        if layout == "sliced":
            return base[:, :, ::2]
        return base

    n, start = 5, 1
    torch.manual_seed(0)
    one = torch.nn.functional.dropout(made(n), 0.5) / made(n)  # one device's mask
    torch.manual_seed(0)
    mine = torch.nn.functional.dropout(_ones(made(k), n), 0.5)[start:start + k]
    torch.testing.assert_close(mine, one[start:start + k])
