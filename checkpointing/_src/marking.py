"""The Checkpointer's side of the save marks (checkpointing/_src/marks.py): on_step dispatches them itself.

A step's marks are dispatched the moment its state reaches on_step, before anything there can block (the
wait for the previous save, Orbax's copy): its fingerprints where a save of the step is certain, its
summaries where a probe window ends there on the devices (Saver.marks_due). The save then dispatches no
pass of its own: inside save() that pass blocked it ~20 ms at 1 GiB on CPU (docs/performance.md).
`Prepared` makes the fingerprints' executable ahead (Checkpointer.prepare), so a restart's restore and a
preemption's save compile nothing.
"""

import concurrent.futures

import jax
from jax.sharding import Mesh, NamedSharding

from checkpointing._src import marks as marks_lib

# Loads a kept executable beside the caller's own compiles: a load compiles nothing and changes no setting.
_LOADER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="marks-load")


def _marks_of(tree) -> marks_lib.MarksFn | None:
    """The marks of `tree`'s layout (arrays or ShapeDtypeStructs), or None where its leaves are not all on
    NamedShardings of one mesh (a save of it then takes its own pass)."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(tree)]
    if not shardings or not all(isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh) for s in shardings):
        return None
    if len({s.mesh for s in shardings}) != 1:
        return None
    return marks_lib.marks_fn(jax.tree.map(lambda x: x.sharding, tree))


def dispatch(state, fingerprints: bool, summaries: bool) -> tuple[jax.Array | None, jax.Array | None]:
    """(uint32[n, 2] fingerprints, float32[n, 2] summaries) of `state`, dispatched, not waited for; each only
    where asked, else None (both None where the state's layout takes no marks)."""
    marks = _marks_of(state) if fingerprints or summaries else None
    if marks is None:
        return None, None
    return marks.fingerprint(state) if fingerprints else None, marks.summary(state) if summaries else None


def summaries_of(state) -> dict[str, list[float]]:
    """{key path: [sum, norm]} of `state` as on_step's marks take them (blocks): the verifier's cheap proof
    computes a replayed state's this way, so they equal the trainer's bit for bit on the same layout."""
    _, summaries = dispatch(state, False, True)
    if summaries is None:
        raise ValueError("the state's leaves are not all on NamedShardings of one mesh: it has no marks")
    return marks_lib.summaries_of(summaries, marks_lib.leaf_paths(state))


def summaries_ahead(abstract_state) -> None:
    """Starts compiling the summaries of states like `abstract_state` on a thread (the first probe then waits
    only for what is left of it; on a TPU a compile at the probe stopped the loop 6-15 s)."""
    marks = _marks_of(abstract_state)
    if marks is not None:
        marks.compile_summaries_ahead(abstract_state)


class Prepared:
    """The fingerprints' executable for one layout, in the making (Checkpointer.prepare): an executable an
    earlier launch kept loads on a thread from the start; `result()` waits for it, or compiles one."""

    def __init__(self, abstract_state):
        if _marks_of(abstract_state) is None:
            raise ValueError("prepare: the abstract state's leaves must all be on NamedShardings of one mesh")
        self._abstract_state = abstract_state
        self._source: str | None = None
        self._loading = _LOADER.submit(marks_lib.compile_marks, abstract_state, load_only=True)

    def result(self) -> str:
        """"disk" (loaded) or "compiled". A compile runs on the calling thread, never beside the caller's own:
        keeping what it compiled turns JAX's persistent cache off meanwhile (checkpointing/_src/executables.py)."""
        if self._source is None:
            self._source = self._loading.result() or marks_lib.compile_marks(self._abstract_state)
        return self._source
