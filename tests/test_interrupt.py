"""`interrupt.deferred`: which signal handlers it takes while `fit` runs, and gives back.

The real signals, sent to training processes, are tests/test_faults.py's,
tests/test_checkpoint.py's and tests/test_multihost.py's."""

import os
import signal
import warnings

import pytest

from keras_multigpu import interrupt


@pytest.fixture
def default_handlers():
    """SIGINT and SIGTERM at Python's defaults (a background test run ignores SIGINT)."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_both_signals_are_deferred_and_given_back(default_handlers):
    with interrupt.deferred():
        assert signal.getsignal(signal.SIGINT) is interrupt._handler
        assert signal.getsignal(signal.SIGTERM) is interrupt._handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sigterm_records_its_name_and_the_boundary_raises_it(default_handlers, capsys):
    with interrupt.deferred():
        signal.raise_signal(signal.SIGTERM)  # the handler runs before the next bytecode
        assert interrupt.requested()
        with pytest.raises(interrupt.Interrupted, match="Stopped by SIGTERM") as raised:
            interrupt.StopOnInterrupt()._check()
    assert raised.value.signum == signal.SIGTERM
    assert "SIGTERM: stopping after the current step" in capsys.readouterr().err
    assert not interrupt.requested()


@pytest.mark.parametrize("own", [signal.SIG_IGN, lambda signum, frame: None],
                         ids=["ignored", "the-scripts-own"])
def test_a_sigterm_handler_not_at_its_default_is_left_alone(default_handlers, own):
    signal.signal(signal.SIGTERM, own)
    with interrupt.deferred():
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGINT) is interrupt._handler
    assert signal.getsignal(signal.SIGTERM) is own


def test_a_process_forked_during_a_call_gets_the_earlier_handlers_back(default_handlers):
    """A PyDataset's `use_multiprocessing=True` workers are forked during `fit`, and Keras ends
    them with SIGTERM: with the deferring handler they lived on (tests/test_faults.py's
    `test_a_pydatasets_worker_processes_end_as_without_the_library` runs them)."""
    with interrupt.deferred(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        child = os.fork()
        if child == 0:  # the child: nothing but the check, then out
            restored = (signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
                        and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
            # The signals, blocked in the forking thread while it forked, are unblocked.
            unblocked = not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(
                signal.SIG_BLOCK, [])
            with interrupt.deferred():  # its own call defers afresh
                own = signal.getsignal(signal.SIGTERM) is interrupt._handler
            os._exit(0 if restored and unblocked and own else 1)
        _, status = os.waitpid(child, 0)
        assert signal.getsignal(signal.SIGTERM) is interrupt._handler  # this process defers
        assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_signal_in_another_process_acts_as_its_earlier_handler(default_handlers):
    """Where a forked process could not take its handlers back, the deferring handler acts as
    the earlier one would: Python's Ctrl-C raises KeyboardInterrupt at once."""
    with interrupt.deferred():
        interrupt._STATE.pid = os.getpid() + 1  # as in another process (the call resets it)
        with pytest.raises(KeyboardInterrupt) as raised:
            signal.raise_signal(signal.SIGINT)
        assert not isinstance(raised.value, interrupt.Interrupted)
        assert not interrupt.requested()
