"""The suite-cost benchmark counts what it says: a program compiled again by the same process
is one program and one repeat, programs compiled in several processes are summed beyond the
cheapest, compiles are summed by program name and the small ones counted apart, programs that
differ only in shapes share a structure, and a run that ran no test is reported as such (the
whole suite is profiled by hand, never in a test)."""

import json
import textwrap

import pytest


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("suite_compile")


def _record(tests, compiles, trace=None):
    return {"tests": tests, "compiles": compiles, "trace_s": trace or {}}


def test_the_summary_counts_repeats_per_process_and_programs_shared_between_processes(bench):
    one = {"cpu_s": 1.0, "children_cpu_s": 0.5}
    records = {
        "gw0": _record(
            {"t/a.py::x": one, "t/a.py::y": one},
            [
                ("t/a.py::x", "jit_f", "P", 0.4),
                ("t/a.py::y", "jit_f", "P", 0.3),  # the same program again, this process
                ("t/a.py::y", "jit_g", "Q", 0.2),
            ],
            {"t/a.py::x": 0.25},
        ),
        "gw1": _record(
            {"t/b.py::z": one},
            [("t/b.py::z", "jit_f", "P", 0.1), ("t/b.py::z", "jit_h", "R", 0.7)],
        ),
    }
    summary = bench.summarize(records)
    a, b = summary["files"]["t/a.py"], summary["files"]["t/b.py"]
    assert list(summary["files"]) == ["t/a.py", "t/b.py"]  # costliest first
    assert (a["tests"], a["cpu_s"], a["children_cpu_s"], a["trace_lower_s"]) == (2, 2.0, 1.0, 0.25)
    assert (a["compiles"], a["programs"], a["repeat_compiles"]) == (3, 2, 1)
    assert a["compile_cpu_s"] == pytest.approx(0.9)
    assert a["repeat_compile_cpu_s"] == pytest.approx(0.3)
    assert (b["compiles"], b["programs"], b.get("repeat_compiles", 0)) == (2, 2, 0)
    total = summary["total"]
    assert (total["tests"], total["compiles"], total["programs"]) == (3, 5, 4)
    # P: first compiled at 0.4 s in gw0 and 0.1 s in gw1; one shared cache pays the 0.1
    assert summary["programs_in_more_than_one_process"] == 1
    assert summary["their_compile_cpu_s_beyond_one_process"] == pytest.approx(0.4)
    # by name, costliest first: jit_f is one program compiled three times in two files
    assert list(summary["names"]) == ["jit_f", "jit_h", "jit_g"]
    f = summary["names"]["jit_f"]
    assert (f["compiles"], f["programs"], f["files"], f["costliest_file"]) == (3, 1, 2, "t/a.py")
    assert f["compile_cpu_s"] == pytest.approx(0.8)
    assert summary["names"]["jit_h"]["costliest_file"] == "t/b.py"
    assert "small_compiles" not in total  # none under 50 ms here
    # records without structures: each program its own
    assert summary["structures"] == {
        "programs": 3,
        "structures": 3,
        "programs_sharing_a_structure": 0,
        "their_compile_cpu_s_beyond_one_per_structure": 0,
    }


def test_programs_that_differ_only_in_shapes_share_a_structure(bench, capsys):
    one = {"cpu_s": 3.0, "children_cpu_s": 0.0}
    records = {
        "gw0": _record(
            {"t/a.py::x": one},
            [
                ("t/a.py::x", "jit_train_step", "B4", 1.0, "S"),  # batch 4
                ("t/a.py::x", "jit_train_step", "OTHER", 0.5, "S2"),  # another model
            ],
        ),
        "gw1": _record(
            {"t/b.py::y": one},
            [
                ("t/b.py::y", "jit_train_step", "B8", 1.5, "S"),  # batch 8: the same structure
                ("t/b.py::y", "jit_train_step", "B4", 0.75, "S"),  # B4 here too, cheaper
            ],
        ),
    }
    summary = bench.summarize(records)
    step = summary["names"]["jit_train_step"]
    assert (step["programs"], step["structures"], step["programs_sharing_a_structure"]) == (3, 2, 2)
    # each program once at its cheapest (B4: 0.75); beyond the cheapest of structure S: B8's 1.5
    assert step["their_compile_cpu_s_beyond_one_per_structure"] == pytest.approx(1.5)
    assert summary["structures"]["their_compile_cpu_s_beyond_one_per_structure"] == pytest.approx(
        1.5
    )
    bench.print_table(summary, top=5)
    printed = capsys.readouterr().out
    assert "only in shapes and constants: 2 of 3 (2 structures), 1.5 compile CPU s" in printed
    (row,) = [line for line in printed.splitlines() if line.startswith("jit_train_step")]
    assert row.split()[1:5] == ["4", "3", "2", "1.5"]  # compiles, programs, structures, alike


def test_small_compiles_are_counted_apart_and_names_printed(bench, capsys):
    records = {
        "main": _record(
            {"t/a.py::x": {"cpu_s": 1.0, "children_cpu_s": 0.0}},
            [
                ("t/a.py::x", "jit_add", "A", 0.01),  # small: an eager operation
                ("t/a.py::x", "jit_add", "B", 0.049),  # another shape, still small
                ("t/a.py::x", "jit_train_step", "T", 1.5),
            ],
        )
    }
    summary = bench.summarize(records)
    total = summary["total"]
    assert (total["small_compiles"], total["compiles"]) == (2, 3)
    assert total["small_compile_cpu_s"] == pytest.approx(0.059)
    assert summary["names"]["jit_add"]["programs"] == 2
    bench.print_table(summary, top=1)
    printed = capsys.readouterr().out
    assert "compiles under 50 ms: 2 of 3, 0.1 of 1.6 compile CPU s" in printed
    assert "jit_train_step" in printed and "96.2%" in printed  # 1.5 of 1.559
    assert "jit_add" not in printed.split("program name")[1].split("... 1 more")[0]
    assert "... 1 more names" in printed


@pytest.mark.integration
def test_a_run_of_pytest_is_profiled_and_written(bench, tmp_path, capsys):
    """The benchmark runs pytest with itself as a plugin on a file of two tests: one jits a
    computation, the other jits a fresh closure over the same computation (one program, compiled
    again) and a second one."""
    test_file = tmp_path / "test_two.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import jax
            import jax.numpy as jnp

            def test_first():
                assert jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(8)).shape == (8,)

            def test_again_and_another():
                assert jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(8)).shape == (8,)
                assert jax.jit(lambda x: jnp.cos(x) + 1)(jnp.ones(8)).shape == (8,)

            def test_another_shape_and_dtype():
                assert jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(4)).shape == (4,)
                assert jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(4, jnp.float16)).shape == (4,)
            """
        )
    )
    out = tmp_path / "suite.json"
    pytest_args = ["-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path)]
    code = bench.main(["--out", str(out), "--", *pytest_args, str(test_file)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "XLA CPU s" in printed and "test_two.py" in printed
    summary = json.loads(out.read_text())
    (name,) = [f for f in summary["files"] if f.endswith("test_two.py")]
    row = summary["files"][name]
    assert row["tests"] == 3 and row["cpu_s"] > 0
    # the two tests' programs: sin*2 twice (one repeat) and cos+1; inputs made eagerly may add
    # programs of their own, each compiled once
    assert row["repeat_compiles"] == 1 and row["repeat_compile_cpu_s"] > 0
    assert row["compiles"] == row["programs"] + 1 >= 3
    assert summary["pytest_exit"] == 0 and summary["processes"] == 1
    lambdas = summary["names"]["jit__lambda"]  # both closures are named after `lambda`
    assert (lambdas["compiles"], lambdas["programs"]) == (5, 4)
    # sin * 2 on 8 and on 4 elements: one structure; on float16 another
    assert (lambdas["structures"], lambdas["programs_sharing_a_structure"]) == (3, 2)
    assert lambdas["costliest_file"] == name


@pytest.mark.integration
def test_a_run_without_tests_says_so_and_fails(bench, tmp_path, capsys):
    empty = tmp_path / "test_none.py"
    empty.write_text("")
    out = tmp_path / "suite.json"
    code = bench.main(["--out", str(out), "--", "-p", "no:xdist", "-q", str(empty)])
    assert code == 5  # pytest's own "no tests ran"
    assert "ran no test" in capsys.readouterr().err
    assert not out.exists()
