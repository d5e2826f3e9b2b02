"""Deprecated alias of `dgemma.parallel.load` (moved in 0.2); importing it warns, and it goes in dgemma 0.3."""

import warnings

from dgemma.parallel.load import load_split_model  # noqa: F401

warnings.warn("dgemma.model.parallel_load has moved: from dgemma.parallel import load_split_model; the old module "
              "goes in dgemma 0.3", DeprecationWarning, stacklevel=2)
