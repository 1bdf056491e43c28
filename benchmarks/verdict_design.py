"""The genuine part of the verdict matrix as a covering design (benchmarks/verdict_matrix.py --design=covering).

Issue 56's dimensions: the model family, the interval between saves (a run is two intervals: the first proved
from the init, the second from a saved step), the layout that records the run and the verifier's device count.
Their whole product (7 x 4 x 3 x 4 = 336 runs, each a training and a proof) does not fit a benchmark; this
design puts every value of every dimension with every family at least once, with no choice of which cases pass:
each family walks the intervals in order while the recording layouts and the device counts rotate by the
family's index (a cyclic design), so each family meets them in another pairing.

Per family, training t (t = 0 .. max(intervals, recordings) - 1) uses interval t, recording (t + k) and seed
t of the family (k: the family's index); it is proved on device counts (t + k) and (t + k + 1), and the
cheapest training (the shortest interval) on (t + k + 2) too. With the defaults that is 4 trainings and 9
proofs per family: 28 trainings and 63 proofs.

A verifier of N devices uses a mesh over N of the 8 fake devices. Two and four devices alternate between their
two shapes (data=2 / model=2, data=4 / data=2,model=2); eight devices take another recording layout (the next
in RECORDINGS), since the recording's own mesh on 8 devices is the recording layout, proved bit for bit.
"""

import dataclasses

INTERVALS = (10, 20, 50, 100)
RECORDINGS = ("data=8", "data=4,model=2", "data=2,model=4")
DEVICE_COUNTS = (1, 2, 4, 8)
SHAPES = {1: ("data=1",), 2: ("data=2", "model=2"), 4: ("data=4", "data=2,model=2")}


@dataclasses.dataclass(frozen=True)
class Cell:
    family: str
    seed: int
    interval: int  # steps between saves; the run is two of them
    recording: str  # the trainer's mesh
    verifier_meshes: tuple[str, ...]  # one proof of the run per mesh


def device_count(mesh: str) -> int:
    count = 1
    for item in mesh.split(","):
        count *= int(item.partition("=")[2])
    return count


def verifier_mesh(devices: int, recording: str, variant: int) -> str:
    """The mesh of a verifier of `devices` devices for a run recorded on `recording` (never that layout)."""
    if devices == device_count(recording):
        others = [mesh for mesh in RECORDINGS if mesh != recording and device_count(mesh) == devices]
        return others[(RECORDINGS.index(recording) if recording in RECORDINGS else 0) % len(others)]
    shapes = SHAPES.get(devices, (f"data={devices}",))
    return shapes[variant % len(shapes)]


def covering(families: dict[str, tuple[int, ...]], intervals=INTERVALS, recordings=RECORDINGS,
             device_counts=DEVICE_COUNTS) -> list[Cell]:
    """The cells of the design for `families` ({name: its seeds}), shortest intervals first (a run cut short
    has proved the cheap cells of every family)."""
    cells = []
    trainings = max(len(intervals), len(recordings))
    for k, (name, seeds) in enumerate(families.items()):
        for t in range(trainings):
            counts = [device_counts[(t + k + i) % len(device_counts)] for i in range(3 if t == 0 else 2)]
            recording = recordings[(t + k) % len(recordings)]
            meshes = tuple(verifier_mesh(n, recording, t + k) for n in dict.fromkeys(counts))
            cells.append(Cell(name, seeds[t % len(seeds)], intervals[t % len(intervals)], recording, meshes))
    return sorted(cells, key=lambda cell: (cell.interval, list(families).index(cell.family)))


def gaps(cells: list[Cell], intervals=INTERVALS, recordings=RECORDINGS, device_counts=DEVICE_COUNTS) -> list[str]:
    """Every (family, dimension, value) the cells leave out; none for a covering design."""
    missing = []
    for family in dict.fromkeys(cell.family for cell in cells):
        mine = [cell for cell in cells if cell.family == family]
        seen = {"interval": {cell.interval for cell in mine}, "recording": {cell.recording for cell in mine},
                "devices": {device_count(mesh) for cell in mine for mesh in cell.verifier_meshes}}
        wanted = {"interval": intervals, "recording": recordings, "devices": device_counts}
        missing += [f"{family}: {dim}={value}" for dim, values in wanted.items() for value in values
                    if value not in seen[dim]]
    missing += [f"{cell.family}: proved on its recording layout {cell.recording}" for cell in cells
                if cell.recording in cell.verifier_meshes]
    return missing


def proofs(cells: list[Cell]) -> int:
    return sum(len(cell.verifier_meshes) for cell in cells)


def trained_steps(cells: list[Cell]) -> int:
    return sum(2 * cell.interval for cell in cells)

