"""The device mesh, in one place: its axes, its text ('data=4,model=2', as flags and logs write it), its axis
sizes, and the jax Mesh built from them. The trainer, the verifier, the checkpoint records and the examples
all go through here, so a mesh reads and builds the same everywhere.

    pairs = parse("data=4,model=2")        # (('data', 4), ('model', 2)); '' is () (all devices on data)
    build(pairs)                           # the Mesh over all devices, every axis of AXES present
    format_mesh({"data": 4, "model": 2})   # 'data=4,model=2' (a manifest's dict, or pairs)
"""

import math
from collections.abc import Iterable, Mapping

AXES = ("data", "model")  # every mesh has both, in this order (a missing axis is 1)


class MeshError(ValueError):
    """A mesh's text is invalid; the message names the axis and the text (exit 2, runtime/entry.py)."""


def parse(text: str, flag: str = "--mesh") -> tuple[tuple[str, int], ...]:
    """'data=4,model=2' -> (('data', 4), ('model', 2)); '' -> () (all devices on data)."""
    axes: list[tuple[str, int]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        name = name.strip()
        if name not in AXES:
            raise MeshError(f"{flag}: unknown axis {name!r} in {text!r}; known axes: {', '.join(AXES)}")
        if not sep or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(f"{flag}: axis {name!r} needs a positive integer size, got {item!r}")
        if name in dict(axes):
            raise MeshError(f"{flag}: axis {name!r} given twice in {text!r}")
        axes.append((name, int(size)))
    return tuple(axes)


def check(mesh: Iterable[tuple[str, int]], device_count: int, flag: str = "--mesh") -> None:
    """A mesh that names sizes must use exactly the visible devices (on CPU the error says how to fake more)."""
    total = 1
    for _, size in mesh:
        total *= size
    if mesh and total != device_count:
        raise MeshError(f"{flag}={format_mesh(mesh)} has {total} devices but {device_count} are visible"
                        + (_fake_devices_hint(total) if total > device_count else ""))


def check_subset(mesh: Iterable[tuple[str, int]], device_count: int, flag: str = "--mesh") -> None:
    """A mesh for a process that may leave devices idle (the verifier): it needs at most the visible devices
    and runs on the first of them (`first_devices`), so a shell that fakes 8 CPU devices for the trainer
    runs `--mesh=data=2` as given."""
    total = math.prod(size for _, size in mesh)
    if mesh and total > device_count:
        raise MeshError(f"{flag}={format_mesh(mesh)} has {total} devices but only {device_count} are visible"
                        + _fake_devices_hint(total))


def first_devices(mesh: Iterable[tuple[str, int]]) -> list | None:
    """The devices a subset mesh runs on: the first N of jax.devices() for a mesh of N devices, in
    jax.devices()' order on CPU and TPU alike; None (all of them) for an empty mesh."""
    import jax  # not at import: see build

    mesh = tuple(mesh)
    return jax.devices()[:math.prod(size for _, size in mesh)] if mesh else None


def _fake_devices_hint(wanted: int) -> str:
    import jax  # only for this message: parsing and checking need no JAX

    if jax.default_backend() != "cpu":
        return ""
    return (f" (on CPU, fake them: XLA_FLAGS=--xla_force_host_platform_device_count={wanted}, set before the "
            "command)")


def format_mesh(mesh: Mapping[str, int] | Iterable[tuple[str, int]]) -> str:
    """'data=4,model=2': a mesh (a manifest's dict, or axis pairs) as flags and logs write it."""
    return ",".join(f"{axis}={size}" for axis, size in (mesh.items() if isinstance(mesh, Mapping) else mesh))


def sizes(mesh: Mapping[str, int] | Iterable[tuple[str, int]], device_count: int | None = None) -> dict[str, int]:
    """Every axis of AXES with its size (a missing one is 1); an empty mesh puts `device_count` on data."""
    given = dict(mesh.items() if isinstance(mesh, Mapping) else mesh)
    if not given and device_count is not None:
        given = {"data": device_count}
    return {axis: given.get(axis, 1) for axis in AXES}


def build(mesh: Mapping[str, int] | Iterable[tuple[str, int]] = (), devices=None):
    """The Mesh of these axis sizes over `devices` (default: all; an empty mesh: all of them on data). Its
    axes are Auto: shardings are given at the jit boundaries and XLA partitions inside."""
    import jax  # not at import: the launchers and the scheduler scripts read meshes without JAX
    from jax.sharding import AxisType

    shape = sizes(mesh, len(devices) if devices is not None else jax.device_count())
    return jax.make_mesh(tuple(shape[axis] for axis in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)
