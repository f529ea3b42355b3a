"""Model builders for keras_multigpu."""

from keras_multigpu.models.minigooglenet import (
    MINI_GOOGLENET_PARAMS,
    mini_googlenet,
    small_convnet,
)

__all__ = ["MINI_GOOGLENET_PARAMS", "mini_googlenet", "small_convnet"]
