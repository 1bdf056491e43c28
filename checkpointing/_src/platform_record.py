"""What decides the bits a step computes besides the config and the layout: the platform, as every
manifest records it (`platform`).

    {"backend": "tpu", "device_kind": "TPU v5 lite", "jax": <version>, "jaxlib": <version>,
     "libtpu": <version> | None, "matmul_precision": "default", "x64": False}

A replay on the same platform and layout is bit-exact; on another one (another backend, device kind,
compiler version, or a matmul precision below float32 on an accelerator) it is not, and a verifier says
so instead of blaming the step. Manifests written before the record have none: unknown.
"""

import functools
import importlib.metadata

import jax

_LIBTPU_PACKAGES = ("libtpu", "libtpu-nightly")  # the name the TPU runtime is installed under


def record() -> dict:
    """This process's platform, with the matmul precision and x64 in effect on the calling thread (a
    `jax.default_matmul_precision(...)` block around a user's loop counts)."""
    precision = jax.config.jax_default_matmul_precision
    return {**_static(), "matmul_precision": "default" if precision is None else str(precision),
            "x64": bool(jax.config.jax_enable_x64)}


@functools.cache
def _static() -> dict:
    # Read once per process: the backend cannot change, and every save's manifest takes a copy.
    import jaxlib.version

    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "jax": jax.__version__, "jaxlib": jaxlib.version.__version__, "libtpu": _libtpu_version()}


def _libtpu_version() -> str | None:
    for name in _LIBTPU_PACKAGES:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_FIELDS = {"backend": str, "device_kind": str, "jax": str, "jaxlib": str, "libtpu": (str, type(None)),
           "matmul_precision": str, "x64": bool}


def is_valid(value) -> bool:
    """Whether `value` has the record's shape: exactly its fields, each of its type."""
    return isinstance(value, dict) and set(value) == set(_FIELDS) and all(
        isinstance(value[name], kind) for name, kind in _FIELDS.items())


def describe(platform: dict | None) -> str:
    """'TPU v5 lite', 'cpu, highest': the device kind, and the matmul precision when it is not the default;
    '-' for a manifest that records none."""
    if not platform:
        return "-"
    precision = platform["matmul_precision"]
    return platform["device_kind"] + ("" if precision == "default" else f", {precision}")
