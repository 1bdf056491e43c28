"""The verdict matrix's covering design (benchmarks/verdict_design.py): every interval, recording layout and
verifier device count with every family, never a proof on the recording layout, cheap cells first."""

from benchmarks import verdict_design

FAMILIES = {"mlp": (0, 1, 2), "wide_mlp": (4, 5, 6), "transformer": (0, 1, 2), "transformer_bf16": (0, 1, 2),
            "bn_classifier": (0, 1, 2), "cnn": (0, 1, 2), "own_loop": (0, 1, 2)}


def test_the_design_covers_every_value_of_every_dimension_with_every_family():
    cells = verdict_design.covering(FAMILIES)
    assert verdict_design.gaps(cells) == []
    assert verdict_design.proofs(cells) >= 60, "issue 56 asks for at least 60 genuine runs"
    assert {cell.seed for cell in cells if cell.family == "wide_mlp"} == {4, 5, 6}


def test_a_verifier_never_proves_on_the_layout_that_recorded_the_run():
    for cell in verdict_design.covering(FAMILIES):
        for mesh in cell.verifier_meshes:
            assert mesh != cell.recording, cell
            assert verdict_design.device_count(mesh) in verdict_design.DEVICE_COUNTS, cell


def test_the_shortest_intervals_come_first():
    intervals = [cell.interval for cell in verdict_design.covering(FAMILIES)]
    assert intervals == sorted(intervals)


def test_a_design_with_a_gap_says_which():
    cells = [cell for cell in verdict_design.covering(FAMILIES) if not (cell.family == "cnn" and cell.interval == 50)]
    assert "cnn: interval=50" in verdict_design.gaps(cells)
