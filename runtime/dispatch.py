"""How far ahead of the devices a host may dispatch steps: a fact of the backend, not of a model."""


def blocks_each_step(mesh) -> bool:
    """Whether a loop must wait for each step before dispatching the next.

    XLA's CPU runtime runs every (fake) device of a process on a pool with one thread per
    device, and its in-process collectives need all of a step's device tasks running at once.
    With a second step's tasks queued behind a blocked one the pool can deadlock (seen about
    once in a few hundred 8-device steps on 2 cores). On CPU the wait costs nothing measurable;
    on TPU and GPU the loop stays fully asynchronous.
    """
    import jax

    return jax.default_backend() == "cpu" and mesh.size > 1
