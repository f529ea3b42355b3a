"""Real Keras 3 programs from public sources, each trained on one device and through the
wrapper (see tests/test_programs.py). Each module names its source at the top, keeps the
source's model and training setup, and replaces its dataset with synthetic data of the same
shapes. No module imports keras_multigpu: a saved file must reload without it.

Every module defines:

- SOURCE: where the program comes from.
- SAVE: "keras" (the whole model in a .keras file), "weights" (a .weights.h5 file, for
  subclassed models whose source gives them no config) or None (Keras cannot save it).

Optional: BACKENDS (the backends its own step is written for), PREDICT = False (no `call`),
RANDOM_PREDICT = True (predictions draw: a reload is checked on its weights),
AMPLIFIED with EXACT_OPTIMIZER and FLOAT64, CONTROL (see tests/test_programs.py),
fine_tune(model, target, optimizer=None) (a second phase: it changes the model and
compiles `target` again, then the same fit runs once more).
- build(): the model, uncompiled (called after keras.utils.set_random_seed).
- compile(model): the source's compile call, on the model or on its ParallelModel.
- fit_kwargs(workdir): the source's fit arguments, with a global batch that divides
  neither 2 nor 3 devices, nor the dataset.
- predict_x(): inputs for predict.
"""
