"""The experiment's settings, apart from the experiment: the CLI builds its parser from them
without importing Keras (so `keras-multigpu --help` works before a backend is installed)."""

import dataclasses
import math


@dataclasses.dataclass
class Config:
    """One training run; CLI flags map one-to-one to these fields."""

    gpus: int | None = None
    epochs: int = 70
    batch_per_device: int = 64
    lr: float = 5e-3
    momentum: float = 0.9
    width: float = 1.0
    limit: int | None = None
    data_dir: str | None = None
    seed: int = 42
    augment: bool = True
    precision: str = "float32"
    output: str = "runs/minigooglenet"
    verbose: int | str = "auto"

    def validate(self):
        for name in ("epochs", "batch_per_device"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}.")
        for name in ("lr", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 < value < math.inf
            ):
                raise ValueError(
                    f"{name} must be a positive finite number. Received: {name}={value!r}."
                )
        if self.verbose not in ("auto", 0, 1, 2):
            raise ValueError(
                f"verbose must be 'auto', 0, 1 or 2. Received: verbose={self.verbose!r}."
            )
        if self.precision not in ("float32", "mixed_bfloat16", "mixed_float16"):
            raise ValueError(
                "precision must be float32, mixed_bfloat16 or mixed_float16. "
                f"Received: precision={self.precision!r}."
            )
