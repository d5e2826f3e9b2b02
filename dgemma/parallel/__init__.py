"""The network split over the ranks of a torch.distributed process group (tensor and expert parallel): the
plan (plan.py), the process group and its collectives (group.py), the split modules (modules.py) and each
rank's slices read from the shards (load.py)."""

from dgemma.parallel.group import TensorParallel, join
from dgemma.parallel.load import load_split_model
from dgemma.parallel.plan import SplitError, check_split, plan_bytes

__all__ = ["TensorParallel", "join", "load_split_model", "SplitError", "check_split", "plan_bytes"]
