"""Deprecated alias of `dgemma.parallel` (the split plan, the process group and the split modules moved
there in 0.2); importing it warns, and it goes in dgemma 0.3."""

import warnings

from dgemma.parallel.group import TensorParallel, join  # noqa: F401
from dgemma.parallel.modules import split_model  # noqa: F401
from dgemma.parallel.plan import SplitError, check_split, parameter_slices, plan_bytes  # noqa: F401

warnings.warn("dgemma.model.parallel has moved to dgemma.parallel (from dgemma.parallel import join, check_split, "
              "plan_bytes); the old module goes in dgemma 0.3", DeprecationWarning, stacklevel=2)
