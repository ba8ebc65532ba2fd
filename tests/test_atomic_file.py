"""Specification of files written whole or not at all (cospec.atomic_file): a reader sees the
old file or the new one, never a part; a failed or interrupted write changes nothing and leaves
nothing behind."""

import json

import pytest
import torch

from cospec.atomic_file import (replaced_atomically, save_figure_atomically, temporary_sibling,
                                write_json_atomically, write_text_atomically)


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    write_json_atomically(path, {"tau": 2.5, "steps": [1, 2]})
    assert json.loads(path.read_text()) == {"tau": 2.5, "steps": [1, 2]}
    assert path.read_text().endswith("\n")
    assert leftovers(tmp_path) == []


def test_until_the_block_ends_a_reader_sees_the_old_file(tmp_path):
    path = tmp_path / "latest"
    write_text_atomically(path, "step-000001\n")
    with replaced_atomically(path) as tmp:
        tmp.write_text("step-0000")  # half of the new content
        assert path.read_text() == "step-000001\n"
        tmp.write_text("step-000002\n")
    assert path.read_text() == "step-000002\n"


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_write_that_fails_or_is_interrupted_keeps_the_old_file_and_removes_its_temporary(tmp_path, failure):
    path = tmp_path / "state.pt"
    torch.save({"step": 1}, path)
    with pytest.raises(type(failure)):
        with replaced_atomically(path) as tmp:
            torch.save({"step": 2}, tmp)
            raise failure
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert leftovers(tmp_path) == []


def test_an_object_that_is_not_json_touches_nothing(tmp_path):
    path = tmp_path / "summary.json"
    with pytest.raises(TypeError):
        write_json_atomically(path, {"when": object()})
    assert list(tmp_path.iterdir()) == []


def test_a_block_that_writes_nothing_is_an_error_not_an_empty_file(tmp_path):
    path = tmp_path / "part-00000.jsonl"
    path.write_text('{"i": 0}\n')
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with replaced_atomically(path) as tmp:
            assert not tmp.exists()  # the writer returns without writing
    assert path.read_text() == '{"i": 0}\n'


def test_a_killed_writers_leftover_is_overwritten_not_read(tmp_path):
    path = tmp_path / "made_by.json"
    temporary_sibling(path).write_text("half a stamp")  # a writer killed before its rename
    assert not path.exists()
    write_json_atomically(path, {"fingerprint": "abc"})
    assert json.loads(path.read_text()) == {"fingerprint": "abc"}
    assert leftovers(tmp_path) == []


def test_the_temporary_is_a_hidden_sibling_so_globs_of_the_final_names_skip_it(tmp_path):
    tmp = temporary_sibling(tmp_path / "train" / "part-00003.jsonl")
    assert tmp.parent == tmp_path / "train"
    assert tmp.name.startswith(".") and not tmp.match("part-*.jsonl")


def test_a_figure_is_saved_whole_in_its_suffixs_format_or_not_at_all(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    png = save_figure_atomically(fig, tmp_path / "curve.png", dpi=50)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert save_figure_atomically(fig, tmp_path / "curve.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="xyz"):  # a format matplotlib does not know
        save_figure_atomically(fig, tmp_path / "curve.xyz")
    first = png.read_bytes()

    def interrupted(fname, **kwargs):  # a save stopped halfway through the file
        fname.write_bytes(first[:10])
        raise KeyboardInterrupt

    fig.savefig = interrupted
    with pytest.raises(KeyboardInterrupt):
        save_figure_atomically(fig, png, dpi=50)
    plt.close(fig)
    assert png.read_bytes() == first and not (tmp_path / "curve.xyz").exists()
    assert leftovers(tmp_path) == []
