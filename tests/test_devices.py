"""Tests for keras_multigpu.devices: choosing devices and counting them."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import keras_multigpu
from keras_multigpu import devices
from keras_multigpu.devices import CPU_DEVICES_ENV, Device, cpu_device_count, list_devices, select

FOUR = [Device(i, "gpu", "Test GPU", 16 * 2**30) for i in range(4)]


@pytest.fixture(autouse=True)
def _framework_not_started_before(monkeypatch):
    """As if no test before had asked the started framework for another device count (the
    suite's own tests do: then `list_devices` lists the devices it kept)."""
    monkeypatch.setattr(devices, "_started_with", None)


def ids(chosen):
    return [d.id for d in chosen]


# -- select: valid values ---------------------------------------------------


def test_none_selects_every_device():
    chosen = select(None, FOUR)
    assert chosen == FOUR
    assert chosen is not FOUR  # a new list: the caller may not mutate ours


@pytest.mark.parametrize("k", [2, 3, 4])
def test_int_selects_the_first_k(k):
    assert ids(select(k, FOUR)) == list(range(k))


@pytest.mark.parametrize("k", [0, 1])
def test_zero_and_one_select_one_device(k):
    assert select(k, FOUR) == [FOUR[0]]


def test_list_keeps_the_order_given():
    assert ids(select([3, 0, 2], FOUR)) == [3, 0, 2]
    assert select([2], FOUR) == [FOUR[2]]


def test_tuple_is_accepted_like_a_list():
    assert ids(select((1, 3), FOUR)) == [1, 3]


def test_device_records_are_accepted_in_the_list():
    chosen = select([FOUR[3], 1], FOUR)
    assert chosen == [FOUR[3], FOUR[1]]


def test_select_returns_the_available_records_themselves():
    chosen = select([1], FOUR)
    assert chosen[0] is FOUR[1]
    assert chosen[0].memory_bytes == 16 * 2**30


def test_numpy_integers_count_and_name_devices_as_ints_do():
    """A count or ids read from an array (np.int64) were refused as of type int64."""
    assert ids(select(np.int64(2), FOUR)) == [0, 1]
    assert ids(select([np.int32(3), np.int64(1)], FOUR)) == [3, 1]
    with pytest.raises(ValueError, match="gpus=5 but"):
        select(np.int64(5), FOUR)


def test_select_on_this_process_devices():
    available = list_devices()
    assert ids(select(3, available)) == [0, 1, 2]
    assert ids(select([7, 5], available)) == [7, 5]


# -- select: refused values -------------------------------------------------


@pytest.mark.parametrize("gpus", [-1, -8])
def test_negative_int_is_refused(gpus):
    with pytest.raises(ValueError, match=rf"gpus must be >= 0\. Received: gpus={gpus}\.") as info:
        select(gpus, FOUR)
    assert type(info.value) is ValueError


def test_more_than_available_lists_the_ids_and_suggests_none():
    with pytest.raises(ValueError, match=r"gpus=5") as info:
        select(5, FOUR)
    message = str(info.value)
    assert "0, 1, 2, 3" in message
    assert "4 GPU device(s)" in message
    assert "gpus=None" in message


def test_more_than_available_on_this_process():
    with pytest.raises(ValueError, match=r"gpus=9") as info:
        select(9, list_devices())
    assert "0, 1, 2, 3, 4, 5, 6, 7" in str(info.value)
    assert "gpus=None" in str(info.value)


def test_more_cpu_devices_than_there_are_says_how_to_have_them(monkeypatch):
    """A count over the CPU's devices names the variable and the launcher that give more;
    a count over a machine's GPUs does not (no CPU split makes GPUs)."""
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    with pytest.raises(ValueError, match=r"gpus=3") as info:
        select(3, [Device(0, "cpu", "host")])
    assert "KERAS_MULTIGPU_CPU_DEVICES=3" in str(info.value)
    assert "keras-multigpu launch -n 3" in str(info.value)
    with pytest.raises(ValueError, match=r"gpus=5") as info:
        select(5, FOUR)
    assert "KERAS_MULTIGPU_CPU_DEVICES" not in str(info.value)


def test_more_cpu_devices_than_the_variable_asks_for_name_its_value(monkeypatch):
    """`KERAS_MULTIGPU_CPU_DEVICES=2 keras-multigpu train --gpus 5` was told to start with
    KERAS_MULTIGPU_CPU_DEVICES=5, not that the variable, set to 2, sets the count."""
    monkeypatch.setenv(CPU_DEVICES_ENV, "2")
    with pytest.raises(ValueError, match=r"KERAS_MULTIGPU_CPU_DEVICES=2 is set in the "
                       r"environment, and sets the count: set it to 5"):
        select(5, [Device(0, "cpu", "host"), Device(1, "cpu", "host")])


def test_a_framework_started_before_the_import_is_named_and_listed(monkeypatch,
                                                                   fresh_list_devices):
    """A model run before `import keras_multigpu`: JAX kept its 1 device, list_devices
    listed the variable's 3, and the error said to set the variable, which was set."""
    monkeypatch.setenv(CPU_DEVICES_ENV, "3")
    devices.framework_started_with(1)
    assert [str(d) for d in list_devices()] == ["cpu:0"]
    with pytest.raises(ValueError, match=r"KERAS_MULTIGPU_CPU_DEVICES=3 is set, but the "
                       r"framework had started before keras_multigpu was imported, and keeps "
                       r"1: import keras_multigpu before"):
        select(3, list_devices())


def test_duplicated_ids_are_refused():
    with pytest.raises(ValueError, match=r"more than once") as info:
        select([1, 2, 1], FOUR)
    assert "[1]" in str(info.value)
    assert "gpus=[1, 2, 1]" in str(info.value)


def test_duplicates_through_device_records_are_refused():
    with pytest.raises(ValueError, match=r"device\(s\) \[0\] more than once"):
        select([FOUR[0], 0], FOUR)


def test_unknown_id_is_refused():
    with pytest.raises(ValueError, match=r"unknown device id\(s\) \[7\]") as info:
        select([0, 7], FOUR)
    assert "gpus=[0, 7]" in str(info.value)
    assert "0, 1, 2, 3" in str(info.value)


def test_empty_list_is_refused():
    with pytest.raises(ValueError, match=r"empty list") as info:
        select([], FOUR)
    assert "gpus=None" in str(info.value)
    assert "0, 1, 2, 3" in str(info.value)


@pytest.mark.parametrize(
    "gpus, shown",
    [
        (True, "gpus=True of type bool"),
        (False, "gpus=False of type bool"),
        (2.0, "gpus=2.0 of type float"),
        ("2", "gpus='2' of type str"),
        ({"a": 1}, "gpus={'a': 1} of type dict"),
        ({0, 1}, "of type set"),
    ],
)
def test_wrong_types_are_refused(gpus, shown):
    with pytest.raises(TypeError, match=re.escape(shown)) as info:
        select(gpus, FOUR)
    assert type(info.value) is TypeError


def test_list_containing_a_str_is_refused():
    with pytest.raises(TypeError, match=re.escape("gpus=[0, '1']")) as info:
        select([0, "1"], FOUR)
    assert "'1' is a str" in str(info.value)


def test_list_containing_a_bool_is_refused():
    with pytest.raises(TypeError, match=r"True is a bool"):
        select([True], FOUR)


# -- cpu_device_count ---------------------------------------------------------


def test_cpu_device_count_unset(monkeypatch):
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    assert cpu_device_count() is None


def test_cpu_device_count_empty_is_unset(monkeypatch):
    monkeypatch.setenv(CPU_DEVICES_ENV, "")
    assert cpu_device_count() is None


def test_cpu_device_count_reads_the_number(monkeypatch):
    monkeypatch.setenv(CPU_DEVICES_ENV, "3")
    assert cpu_device_count() == 3


@pytest.mark.parametrize("raw", ["0", "abc", "-2", "2.5"])
def test_cpu_device_count_refuses_non_positive_integers(monkeypatch, raw):
    monkeypatch.setenv(CPU_DEVICES_ENV, raw)
    with pytest.raises(ValueError, match=re.escape(f"{CPU_DEVICES_ENV}={raw!r}")) as info:
        cpu_device_count()
    assert "positive integer" in str(info.value)


def test_cpu_device_count_refuses_more_than_the_frameworks_start(monkeypatch):
    """100,000 hung: XLA had not started them after 5 minutes."""
    monkeypatch.setenv(CPU_DEVICES_ENV, "100000")
    with pytest.raises(ValueError, match=r"must be at most 1024.*'100000'"):
        cpu_device_count()
    monkeypatch.setenv(CPU_DEVICES_ENV, "1024")
    assert cpu_device_count() == 1024


# -- list_devices and Device -------------------------------------------------


@pytest.fixture
def fresh_list_devices(monkeypatch):
    """An empty list_devices cache now and after the test; no GPUs seen."""
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: [])
    list_devices.cache_clear()
    yield
    list_devices.cache_clear()


def test_list_devices_in_this_process():
    found = list_devices()
    assert len(found) == 8
    assert all(isinstance(d, Device) for d in found)
    assert [d.kind for d in found] == ["cpu"] * 8
    assert ids(found) == list(range(8))
    assert [str(d) for d in found] == [f"cpu:{i}" for i in range(8)]


def test_list_devices_is_cached():
    assert list_devices() is list_devices()


def test_package_exports_list_devices():
    assert keras_multigpu.list_devices is list_devices
    assert keras_multigpu.Device is Device


def test_list_devices_follows_the_env_after_cache_clear(monkeypatch, fresh_list_devices):
    monkeypatch.setenv(CPU_DEVICES_ENV, "3")
    assert ids(list_devices()) == [0, 1, 2]
    assert {d.kind for d in list_devices()} == {"cpu"}
    monkeypatch.delenv(CPU_DEVICES_ENV)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert len(list_devices()) == 3  # still cached
    list_devices.cache_clear()
    assert ids(list_devices()) == [0, 1, 2, 3]  # the count the user gave XLA
    monkeypatch.delenv("XLA_FLAGS")
    list_devices.cache_clear()
    only = list_devices()
    assert only == [Device(0, "cpu", "CPU")]


def test_list_devices_prefers_gpus(monkeypatch):
    gpus = [Device(0, "gpu", "Test GPU", 2**30)]
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: gpus)
    list_devices.cache_clear()
    try:
        assert list_devices() == gpus
    finally:
        list_devices.cache_clear()


def test_device_str():
    assert str(Device(3, "cpu", "virtual CPU")) == "cpu:3"
    assert str(Device(1, "gpu", "NVIDIA H100", 80 * 2**30)) == "gpu:1"


def test_device_is_frozen():
    device = Device(0, "cpu", "CPU")
    with pytest.raises(AttributeError):
        device.id = 1


# -- fresh processes -----------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json
    import keras_multigpu
    from jax._src import xla_bridge

    started_by_import = xla_bridge.backends_are_initialized()
    found = keras_multigpu.list_devices()
    started_by_listing = xla_bridge.backends_are_initialized()
    import jax

    print(json.dumps({
        "started_by_import": started_by_import,
        "started_by_listing": started_by_listing,
        "listed": [str(d) for d in found],
        "jax": [d.platform for d in jax.devices()],
    }))
    """
)


def _probe(env_changes):
    env = dict(os.environ)
    env["KERAS_BACKEND"] = "jax"
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "xla_flags",
    [None, "--xla_force_host_platform_device_count=8"],
    ids=["no-xla-flags", "stale-xla-flag"],
)
def test_env_var_gives_that_many_devices_without_starting_jax(xla_flags):
    report = _probe({CPU_DEVICES_ENV: "3", "XLA_FLAGS": xla_flags})
    assert report["started_by_import"] is False
    assert report["started_by_listing"] is False
    assert report["listed"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert report["jax"] == ["cpu", "cpu", "cpu"]


def test_unset_env_var_gives_one_cpu_device():
    # XLA_FLAGS is dropped too: this test process set a device count there.
    report = _probe({CPU_DEVICES_ENV: None, "XLA_FLAGS": None})
    assert report["started_by_listing"] is False
    assert report["listed"] == ["cpu:0"]
    assert report["jax"] == ["cpu"]
