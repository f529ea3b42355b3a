"""Dataset loaders for keras_multigpu (CIFAR-10 in its python batch format)."""

from keras_multigpu.data.augment import RandomShiftFlip
from keras_multigpu.data.cifar10 import find_cifar10, load_cifar10, read_batch

__all__ = ["RandomShiftFlip", "find_cifar10", "load_cifar10", "read_batch"]
