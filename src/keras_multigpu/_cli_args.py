"""The `keras-multigpu` command's argument types: each refuses a bad value with a line that
says what was received (`_Parser` prints it, with where the usage is)."""

import argparse
import math
import os


class UsageError(Exception):
    """A mistake in the command line, reported without a traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes are one line (exit 2) that names the command's
    `--help`, not the usage block followed by the error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" after every option whose help does not state its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or isinstance(
            action.default, bool
        ):
            return text
        return super()._get_help_string(action)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seed(text):
    """A random seed: what `keras.utils.set_random_seed` takes (0 to 2**32 - 1)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 0 to 2**32 - 1 (4294967295), got {text!r}")
    return value


def _count(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def _gpus(text):
    """`train --gpus`, as `multi_gpu_model(gpus=...)`: a count, a list of ids, or all."""
    text = text.strip()
    if text.lower() == "all":
        return None
    try:
        if "," in text:
            ids = [int(part) for part in text.split(",") if part.strip()]
            if ids and min(ids) >= 0 and len(set(ids)) == len(ids):
                return ids
        elif int(text) >= 0:
            return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        "expected a device count (0 and 1 both mean one device), a list of distinct device "
        f"ids such as 0,2 (one id: 3,) or 'all'; got {text!r}"
    )


def _distinct_counts(text, what, example):
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"expected distinct {what} of at least 1, like {example}; got {text!r}"
        )
    return counts


def _gpu_list(text):
    return _distinct_counts(text, "device counts", "1,2,4")


def _host_counts(text):
    return _distinct_counts(text, "host counts", "1,2,4,16")


def _parameter_count(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1 <= value < math.inf or value != int(value):
        raise argparse.ArgumentTypeError(
            f"expected a whole number of parameters, like 44500000 or 44.5e6; got {text!r}"
        )
    return int(value)


def _port(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}")
    return value


def _env_int(name, default):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name} must be an integer. Received: {name}={raw!r}.") from None


def _needs_experiment(command):
    """`train`, `compare` and `bench` draw figures: matplotlib comes with the extra."""
    from keras_multigpu._extras import require

    require("matplotlib", "experiment", f"keras-multigpu {command}")
