"""Damaged and wrong inputs to ``check``, ``bisect`` and ``export``: exit 2, one line, no traceback.

Every case goes through the command's own entry point (what ``python -m parity ...`` calls) and
asserts three things: exit code 2 (bad input, never 1, which means FAIL), a single ``error:``
line on stderr naming the file or option, and what is wrong with it.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from parity import bisect
from parity.golden import check
from parity.golden.format import HEADER_KEY, SCHEMA_VERSION, GoldenFileError, load_golden

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "examples" / "parity_ci" / "port.golden.npz"


def _one_error_line(capsys, code: int, *needles: str) -> str:
    out, err = capsys.readouterr()
    assert code == 2, (code, out[-2000:], err[-2000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + out
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _check(path, *extra: str) -> int:
    return check.main(["--golden", str(path), "--no-progress", *extra])


def _archive(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def _arrays() -> dict[str, np.ndarray]:
    with np.load(GOLDEN, allow_pickle=False) as archive:
        return {k: archive[k] for k in archive.files}


def test_damaged_files_exit_2_naming_the_file(tmp_path, capsys):
    data = GOLDEN.read_bytes()
    cases = {
        "empty.npz": (b"", "empty file (0 bytes)"),
        "text.npz": (b"step,loss\n0,2.3\n", "not a golden .npz archive"),
        "truncated_half.npz": (data[: len(data) // 2], "truncated or damaged .npz archive"),
        "truncated_tail.npz": (data[:-7], "truncated or damaged .npz archive"),
        "truncated_head.npz": (data[:40], "truncated or damaged .npz archive"),
    }
    # one bit flipped inside a member's compressed bytes: its checksum or its inflation fails
    with zipfile.ZipFile(GOLDEN) as archive:
        info = archive.getinfo("batch/9/inputs.npy")
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + 20
    flipped = bytearray(data)
    flipped[offset] ^= 0x10
    cases["flipped.npz"] = (bytes(flipped), "damaged array 'batch/9/inputs'")
    for name, (content, what) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        _one_error_line(capsys, _check(path), str(path), what)
    _one_error_line(capsys, _check(tmp_path), str(tmp_path), "is a folder")
    _one_error_line(capsys, _check(tmp_path / "absent.npz"), "absent.npz", "no such file")


def test_every_single_bit_flip_loads_intact_or_is_refused(tmp_path):
    """A flip anywhere (local headers, compressed members, the central directory) is either
    harmless (a timestamp) and the arrays read back equal, or a GoldenFileError naming the file:
    never another exception."""
    data = GOLDEN.read_bytes()
    reference = _arrays()
    rng = np.random.default_rng(0)
    positions = np.unique(
        np.concatenate(
            [np.linspace(0, len(data) - 1, 80).astype(int), rng.integers(0, len(data), 40)]
        )
    )
    refused = 0
    path = tmp_path / "flip.npz"
    for position in positions:
        flipped = bytearray(data)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(flipped))
        try:
            golden = load_golden(path)
        except GoldenFileError as e:
            assert str(path) in str(e)
            refused += 1
            continue
        for key, value in golden.arrays.items():
            np.testing.assert_array_equal(value, reference[key])
    assert refused > len(positions) // 2  # most bytes are checksummed data


def test_wrong_version_and_not_a_golden(tmp_path, capsys):
    arrays = _arrays()
    header = json.loads(arrays[HEADER_KEY].tobytes())
    header["schema_version"] = 99
    arrays[HEADER_KEY] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path = tmp_path / "v99.npz"
    path.write_bytes(_archive(arrays))
    _one_error_line(
        capsys, _check(path), str(path), "schema_version 99", f"reads version {SCHEMA_VERSION}"
    )
    path = tmp_path / "plain.npz"
    path.write_bytes(_archive({"x": np.zeros(3)}))
    _one_error_line(capsys, _check(path), str(path), "not a golden file")
    # a header whose stage list holds a number, and one claiming a billion batches
    for change, field in (
        (lambda h: h["step0"].__setitem__("stages", [5]), "step0.stages[0]"),
        (lambda h: h["data"].__setitem__("train_batches", 10**9), "data.train_batches"),
    ):
        arrays = _arrays()
        header = json.loads(arrays[HEADER_KEY].tobytes())
        change(header)
        arrays[HEADER_KEY] = np.frombuffer(json.dumps(header).encode(), np.uint8)
        path.write_bytes(_archive(arrays))
        _one_error_line(capsys, _check(path), str(path), field)


def test_flax_model_that_is_not_a_model(capsys):
    for reference, what in (
        ("os:getcwd", "is not a Flax model"),
        ("math:pi", "is not a Flax model"),
        ("no_such_package.models:Net", "does not import"),
        ("flax.linen:Dense", "calling it with no arguments failed"),
        ("examples.parity_ci.flax_model:NoSuchNet", "has no attribute"),
    ):
        code = _check(GOLDEN, "--flax-model", reference)
        _one_error_line(capsys, code, reference, what)
        code = bisect.main(["--golden", str(GOLDEN), "--flax-model", reference])
        _one_error_line(capsys, code, reference, what)


def test_golden_of_another_model(capsys):
    """The example's golden checked against another port (another hidden width): refused before
    any work, naming the file, the recorded model and the differing leaves."""
    code = _check(GOLDEN, "--flax-model", "test_parity_golden_inputs:wider_port")
    line = _one_error_line(capsys, code, str(GOLDEN), "recorded for model", "do not fit")
    assert "params/fc1/kernel: recorded (64, 32), the model has (64, 48)" in line
    code = bisect.main(
        ["--golden", str(GOLDEN), "--flax-model", "test_parity_golden_inputs:wider_port"]
    )
    _one_error_line(capsys, code, str(GOLDEN), "do not fit")


def wider_port():
    from examples.parity_ci.flax_model import FlaxNet

    return FlaxNet(hidden=48)


def test_bisect_damaged_golden(tmp_path, capsys):
    path = tmp_path / "cut.npz"
    path.write_bytes(GOLDEN.read_bytes()[:1000])
    _one_error_line(capsys, bisect.main(["--golden", str(path)]), str(path), "truncated")


@pytest.mark.torch
def test_export_refuses_bad_inputs_before_torch_runs(tmp_path, capsys):
    pytest.importorskip("torch")
    from parity.cli.commands import main

    base = ["export", "--model", "mlp", "--steps", "2", "--no-progress"]
    for extra, what in (
        (["--out", str(tmp_path)], "is a folder"),
        (["--out", str(tmp_path / "g.npz"), "--flax-model", "os:getcwd"], "is not a Flax model"),
        (
            ["--out", str(tmp_path / "g.npz"), "--data", f"text:{tmp_path / 'none.txt'}"],
            "--data",
        ),
    ):
        _one_error_line(capsys, main(base + extra), what)
    assert not (tmp_path / "g.npz").exists()
