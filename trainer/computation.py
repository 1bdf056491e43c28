"""The identity of a computation: a sha256 of a function's jaxpr, traced on abstract unsharded inputs.

What computes a run's numbers is the program JAX traces, not the files or the git commit that hold it:
a README commit, a copy of the project inside another repository or a pip install change none of it,
while a changed learning-rate schedule, loss term or dtype changes it wherever it was edited. The jaxpr
is taken before sharding and platform lowering (no mesh, no shardings, no backend enter it), printed
without source locations or name stacks (a moved line is not another computation), with any object
address a primitive's parameters print scrubbed, and with the values of its captured constants hashed
beside the text (the printed jaxpr names them but does not show them).

trainer/program.py's `computation` applies it to the init, the step and the batch function of a config;
trainer/code.py records the result in every manifest and verifier/program.py compares it.
"""

import hashlib
import re
from typing import Any, Callable

import jax
import numpy as np

# Object reprs a parameter may print (a custom_jvp rule, a callback): `<function f at 0x7f...>`. Their
# addresses differ in every process; the rest of the repr (the function's name) is kept.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _traced(fn: Callable, *abstract_args: Any):
    """(closed jaxpr, output ShapeDtypeStructs) of `fn` on `abstract_args`."""
    return jax.make_jaxpr(fn, return_shape=True)(*abstract_args)


def _text(closed) -> str:
    return _ADDRESS.sub("", closed.jaxpr.pretty_print(source_info=False, name_stack=False, print_shapes=True))


def jaxpr_text(fn: Callable, *abstract_args: Any) -> tuple[str, list]:
    """The printed jaxpr of `fn` on `abstract_args` (ShapeDtypeStructs without shardings) and its constants."""
    closed, _ = _traced(fn, *abstract_args)
    return _text(closed), list(closed.consts)


def _const_bytes(value) -> bytes:
    """A constant's dtype, shape and bytes (a typed PRNG key: its key data)."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    array = np.asarray(value)
    return f"{array.dtype}{array.shape}".encode() + np.ascontiguousarray(array).tobytes()


def digest(fn: Callable, *abstract_args: Any, return_shape: bool = False):
    """sha256 (hex) of `fn`'s jaxpr on `abstract_args` and of the values of the constants it captured; with
    `return_shape`, (that digest, `fn`'s output as ShapeDtypeStructs), from the same trace."""
    closed, out = _traced(fn, *abstract_args)
    hasher = hashlib.sha256(_text(closed).encode())
    for const in closed.consts:
        hasher.update(_const_bytes(const))
    return (hasher.hexdigest(), out) if return_shape else hasher.hexdigest()


def unsharded(tree):
    """`tree` as ShapeDtypeStructs without shardings (and without weak types: the step's inputs are strong)."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)
