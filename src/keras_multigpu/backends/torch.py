"""The torch engine is not built yet: every entry point says so clearly."""

from keras_multigpu.backends import API
from keras_multigpu.backends._unsupported import unsupported

for _name in API:
    globals()[_name] = unsupported("torch", _name, quiet=_name == "configure_cpu_devices")
del _name
