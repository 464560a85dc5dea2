"""A Python function as an opaque op of captured (torch.compile'd) steps, registered through torch.library's
low-level API: the compiler keeps it as one call (its fake function gives the output's shape) and fuses around it.

Why not `torch.library.custom_op`: it wraps every call in Python layers (autograd, argument handling) that cost
~50 us once a decode step's weight reads have pushed the interpreter's code and data out of the caches, as they
do between the ~14 pool-op calls of a k3-small step; a kernel registered with `Library.impl` costs ~20 us there
(~2 us when hot). The ops are for inference: no autograd formula, and they declare no mutation (the pools they
write are state outside the graph, reached by key).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}


def opaque_op(qualname: str) -> Callable[[Callable[..., object]], torch._ops.OpOverload]:
    """Decorator: define `namespace::name` from the function's type hints, with the function as its kernel on
    every device; returns the op (call it like the function). Register its fake with
    `torch.library.register_fake(qualname)`."""
    namespace, name = qualname.split("::")

    def register(fn: Callable[..., object]) -> torch._ops.OpOverload:
        lib = _LIBRARIES.get(namespace)
        if lib is None:
            lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        lib.define(name + torch.library.infer_schema(fn, mutates_args=()))
        lib.impl(name, fn, "CompositeExplicitAutograd")
        return getattr(getattr(torch.ops, namespace), name).default

    return register
