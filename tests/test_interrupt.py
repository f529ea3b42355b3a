"""`interrupt.deferred`: which signal handlers it takes while `fit` runs, and gives back.

The real signals, sent to training processes, are tests/test_faults.py's,
tests/test_checkpoint.py's and tests/test_multihost.py's."""

import signal

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
