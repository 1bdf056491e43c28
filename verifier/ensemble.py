"""The replays a proof across layouts compares with: the verifier's own (unperturbed), then members perturbed at
the rounding level (verifier/perturb.py), their spread bounding what a genuine execution could record.

One owner for which replays a proof runs, in what order, shared by the full proof (verifier/chain_proof.py)
and the cheap one (verifier/resume_proof.py):

  1. calibration: the interval's first step on the verifier's layout and on its first other layout, from the
     same state: each leaf's rounding across a layout change, which sets its perturbation;
  2. member 1 on that other layout, member 2 on the verifier's own, each perturbed after every step with a seed
     of its own (two members and the unperturbed replay: three pairs to measure a spread with);
  3. member 3, only to confirm what the first judgement calls evidence, on a third layout where there is one.

A verifier with one device has no other layout to calibrate with: no member, and the proof across layouts says
so (inconclusive), never a bound it did not measure.
"""

from typing import Callable, Iterable, Iterator

from verifier import layouts
from verifier import perturb

MEMBERS = 2  # perturbed replays before a judgement
CONFIRMING = 1  # more, only where the first judgement finds evidence
SEEDS = (1, 2, 3)


def members(program, others: Iterable, start_state,
            one_step: Callable[[object, object], object]) -> Iterator[tuple[object, perturb.Perturbation]]:
    """(program, perturbation) of each member in order (module docstring), lazily: the caller stops after
    MEMBERS when it needs no confirmation. `one_step(program, state) -> state`: one step of the interval from
    `state` on `program` (its replay function, with its batches). Yields nothing without another layout."""
    others = iter(others)
    first_other = next(others, None)
    if first_other is None:
        return
    mine = one_step(program, layouts.copy_onto(start_state, program.state_shardings))
    theirs = one_step(first_other, layouts.copy_onto(start_state, first_other.state_shardings))
    rtols = perturb.one_step_rtols(mine, layouts.moved_onto(theirs, program.state_shardings))
    scales = perturb.scales(mine, rtols)
    del mine, theirs
    yield first_other, perturb.Perturbation(first_other.state_shardings, scales, SEEDS[0])
    yield program, perturb.Perturbation(program.state_shardings, scales, SEEDS[1])
    # Only when the first judgement found evidence: a third layout is built (and compiled) on demand.
    third = next(others, None) or first_other
    yield third, perturb.Perturbation(third.state_shardings, scales, SEEDS[2])
