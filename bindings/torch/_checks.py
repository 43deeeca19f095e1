"""The adapter's argument check, called first by every entry point: each array argument is a
``torch.Tensor``, with a TypeError naming the argument and saying what came (a NumPy array among
tensors, a list, None...).  Shapes, dtypes, devices and options are the core's to check
(``sagebwd_cp.problem``, ``sagebwd_cp.options``), with errors of the same form."""
from __future__ import annotations

from torch import Tensor

from sagebwd_cp.arrays import framework_of, what_came

_OTHER_ARRAY = ("; sagebwd_cp.torch takes torch tensors only (convert with torch.from_dlpack or torch.as_tensor, "
                "or call the framework-neutral sagebwd_cp functions)")


def check_tensors(names: str, *tensors, optional: tuple = ()) -> None:
    """``names``: the arguments' names, comma-separated, in the order of ``tensors``; those in
    ``optional`` may be None."""
    for x in tensors:
        if not isinstance(x, Tensor):
            break
    else:
        return
    for name, x in zip(names.split(", "), tensors):
        if isinstance(x, Tensor) or (x is None and name in optional):
            continue
        raise TypeError(f"{name}: expected a torch.Tensor, got {what_came(x)}{_OTHER_ARRAY if framework_of(x) else ''}")


def tensor_list(xs, name: str) -> list:
    """A sequence argument of tensors (chunks of keys, outputs to merge, shards) as a list, each
    element checked as ``name[i]``."""
    if not isinstance(xs, (list, tuple)):
        if xs is None or isinstance(xs, (Tensor, str, bytes, dict)) or framework_of(xs) or not hasattr(xs, "__iter__"):
            raise TypeError(f"{name}: expected a list or tuple of torch tensors, got {what_came(xs)}")
    xs = list(xs)
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            check_tensors(f"{name}[{i}]", x)
    return xs
