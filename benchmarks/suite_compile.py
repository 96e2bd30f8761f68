"""Where a pytest run's CPU seconds go: XLA compiling, JAX tracing and lowering, and the rest.

Runs pytest (by default the README's test command, `-n 2 tests`) with this file loaded as a
plugin in every test process, pytest-xdist's workers included, and prints per test file: the CPU
seconds of its tests (their own process's and the subprocesses they waited for), the CPU seconds
XLA spent compiling, the number of compiles and of distinct programs among them, the compile CPU
seconds spent on a program the same process had compiled before (what a cache could still save),
and the seconds of tracing and lowering. Then the whole run, with the programs compiled in more
than one process and the compiles of under 50 ms (one operation run eagerly compiles in about
that), and a second table by the program's name (``jit_<function>``: which computations the
compile seconds go to, in how many distinct programs, structures and files). Tables on stdout,
JSON in `--out`.

    .venv/bin/python benchmarks/suite_compile.py --out benchmarks/results/suite_compile.json
    .venv/bin/python benchmarks/suite_compile.py -- -p no:xdist tests/jaxamp/test_optim.py

A program is the lowered StableHLO module without its source locations, with its device count:
two tests that build fresh closures over the same computation compile one program twice. Its
structure is the same text without its numbers (sizes, indices, constants) but with its
operations and element types: programs that differ only in shapes and constants (one test's
batch of 4 and another's of 8, not float16 and float32) share a structure, and the compile
seconds of a structure's programs beyond its cheapest one are what giving those tests one shape
could save at most. A compile is XLA's (``jax._src.compiler.compile_or_get_cached``, a JAX
internal this file wraps; a hit in JAX's compilation cache is counted as a compile of little
CPU). Compile seconds are the compiling thread's process CPU seconds over the call (XLA:CPU
compiles on more than one thread); tracing and lowering are JAX's own wall-clock events. Runs of
one commit at different minutes differ by several percent: compare two commits side by side.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import pytest

_OUT_VAR = "SUITE_COMPILE_OUT"
_SMALL_S = 0.05  # a compile under this is counted as small: one eager operation's, typically
# what a program's structure leaves out: dense constants, tensor shapes, then every number that
# does not follow a letter (sizes and indices in attributes, other constants): element types
# (f16, bf16, f8E4M3FN) stay
_CONSTANTS = re.compile(r"dense(?:_resource)?<[^>]*>")
_SHAPES = re.compile(r"tensor<(?:(?:[0-9]+|\?)x)*")
_NUMBERS = re.compile(r"(?<![A-Za-z0-9_])[0-9]+")
_TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)


# --- the plugin: loaded by pytest (`-p suite_compile`) in every test process ---------------------


class _Recorder:
    """Per test: CPU seconds, and each compile's (program, CPU seconds); tracing seconds."""

    def __init__(self):
        self.test = "<outside any test>"
        self.tests: dict[str, dict] = {}
        # test, name, program, CPU s, structure
        self.compiles: list[tuple[str, str, str, float, str]] = []
        self.trace_s: collections.Counter = collections.Counter()

    def install(self) -> None:
        import jax.monitoring
        from jax._src import compiler

        original = getattr(compiler, "compile_or_get_cached", None)
        if original is None:
            raise RuntimeError(
                "suite_compile: jax._src.compiler.compile_or_get_cached is gone in this JAX "
                f"({_jax_version()}): the compile hook needs updating"
            )

        def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
            start = time.process_time()
            executable = original(backend, computation, devices, *args, **kwargs)
            seconds = time.process_time() - start
            name, program, structure = _program(computation, devices)
            self.compiles.append((self.test, name, program, seconds, structure))
            return executable

        compiler.compile_or_get_cached = compile_or_get_cached

        def on_duration(event: str, duration: float, **_) -> None:
            if event in _TRACE_EVENTS:
                self.trace_s[self.test] += duration

        jax.monitoring.register_event_duration_secs_listener(on_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.test = item.nodeid
        before = os.times()
        yield
        after = os.times()
        self.test = "<outside any test>"
        self.tests[item.nodeid] = {
            "cpu_s": after.user + after.system - before.user - before.system,
            "children_cpu_s": max(  # never -0.0 from rounding
                0.0,
                after.children_user
                + after.children_system
                - before.children_user
                - before.children_system,
            ),
        }

    def pytest_sessionfinish(self, session):
        folder = os.environ.get(_OUT_VAR)
        if not folder:
            return
        process = os.environ.get("PYTEST_XDIST_WORKER", "main")
        payload = {
            "tests": self.tests,
            "trace_s": dict(self.trace_s),
            "compiles": self.compiles,
        }
        _write_json_atomic(pathlib.Path(folder) / f"{process}.json", payload)


def _jax_version() -> str:
    import jax

    return jax.__version__


def _program(computation, devices) -> tuple[str, str, str]:
    """(module name, fingerprint of the module without locations and its device count, and of
    its structure: the same without sizes and constants)."""
    operation = computation.operation
    text = operation.get_asm(enable_debug_info=False)
    name = (
        str(operation.attributes["sym_name"]).strip('"')
        if "sym_name" in operation.attributes
        else "?"
    )
    count = getattr(devices, "size", None) or len(devices)
    digest = hashlib.sha256(f"{count}\n{text}".encode()).hexdigest()[:20]
    shape_free = _NUMBERS.sub("N", _SHAPES.sub("tensor<", _CONSTANTS.sub("C", text)))
    structure = hashlib.sha256(f"{count}\n{shape_free}".encode()).hexdigest()[:20]
    return name, digest, structure


def pytest_configure(config):
    """Registered as a plugin: record this process's tests and compiles."""
    if os.environ.get(_OUT_VAR):
        recorder = _Recorder()
        recorder.install()
        config.pluginmanager.register(recorder, "suite_compile_recorder")


# --- the summary ---------------------------------------------------------------------------------


def summarize(records: dict[str, dict]) -> dict:
    """Per file and in all, from each process's record ({process: payload})."""
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    # each program's first compile in each process: beyond the cheapest of those, what one
    # cache shared by the processes could save
    firsts: dict[str, list[float]] = collections.defaultdict(list)
    structure_of: dict[str, str] = {}  # program -> its structure
    # per program name: compiles, distinct programs, compile CPU s per file
    names: dict[str, dict] = collections.defaultdict(
        lambda: {"compiles": 0, "programs": set(), "files": collections.Counter()}
    )
    for payload in records.values():
        for test, row in payload["tests"].items():
            file = test.split("::")[0]
            files[file]["tests"] += 1
            files[file]["cpu_s"] += row["cpu_s"]
            files[file]["children_cpu_s"] += row["children_cpu_s"]
        for test, seconds in payload["trace_s"].items():
            files[test.split("::")[0]]["trace_lower_s"] += seconds
        seen: set[str] = set()
        for test, name, program, seconds, *structure in payload["compiles"]:
            structure_of[program] = structure[0] if structure else program
            path = test.split("::")[0]
            file = files[path]
            file["compiles"] += 1
            file["compile_cpu_s"] += seconds
            if seconds < _SMALL_S:
                file["small_compiles"] += 1
                file["small_compile_cpu_s"] += seconds
            by_name = names[name]
            by_name["compiles"] += 1
            by_name["programs"].add(program)
            by_name["files"][path] += seconds
            if program in seen:
                file["repeat_compiles"] += 1
                file["repeat_compile_cpu_s"] += seconds
            else:
                file["programs"] += 1
                seen.add(program)
                firsts[program].append(seconds)
    for row in files.values():
        totals.update(row)
    shared = {p: s for p, s in firsts.items() if len(s) > 1}
    once = {p: min(s) for p, s in firsts.items()}  # each program compiled once, by its cheapest
    by_names = {
        name: {
            "compiles": row["compiles"],
            "programs": len(row["programs"]),
            **_structures(row["programs"], structure_of, once),
            "compile_cpu_s": sum(row["files"].values()),
            "files": len(row["files"]),
            "costliest_file": row["files"].most_common(1)[0][0],
        }
        for name, row in names.items()
    }
    return {
        "files": {f: dict(row) for f, row in sorted(files.items(), key=lambda kv: -_cost(kv[1]))},
        "total": dict(totals),
        "processes": len(records),
        "programs_in_more_than_one_process": len(shared),
        "their_compile_cpu_s_beyond_one_process": sum(sum(s) - min(s) for s in shared.values()),
        "structures": {"programs": len(once), **_structures(set(once), structure_of, once)},
        "names": dict(sorted(by_names.items(), key=lambda kv: -kv[1]["compile_cpu_s"])),
    }


def _structures(programs: set[str], structure_of: dict[str, str], once: dict[str, float]) -> dict:
    """Distinct structures among `programs`, the programs sharing a structure with another, and
    their compile seconds (each program once) beyond the cheapest program of each structure."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for program in programs:
        groups[structure_of[program]].append(once[program])
    alike = [seconds for seconds in groups.values() if len(seconds) > 1]
    return {
        "structures": len(groups),
        "programs_sharing_a_structure": sum(len(seconds) for seconds in alike),
        "their_compile_cpu_s_beyond_one_per_structure": sum(sum(s) - min(s) for s in alike),
    }


def _cost(row) -> float:
    return row["cpu_s"] + row["children_cpu_s"]


def print_table(summary: dict, top: int) -> None:
    head = (
        f"{'file':58s} {'tests':>5s} {'CPU s':>7s} {'subproc':>7s} {'XLA CPU s':>9s} "
        f"{'compiles':>8s} {'programs':>8s} {'again s':>7s} {'trace s':>7s}"
    )
    print(head)
    print("-" * len(head))

    def line(name: str, row: dict) -> str:
        return (
            f"{name:58s} {row.get('tests', 0):5d} {row.get('cpu_s', 0):7.1f} "
            f"{row.get('children_cpu_s', 0):7.1f} {row.get('compile_cpu_s', 0):9.1f} "
            f"{row.get('compiles', 0):8d} {row.get('programs', 0):8d} "
            f"{row.get('repeat_compile_cpu_s', 0):7.1f} {row.get('trace_lower_s', 0):7.1f}"
        )

    for name, row in list(summary["files"].items())[:top]:
        print(line(name, row))
    rest = len(summary["files"]) - top
    if rest > 0:
        print(f"... {rest} more files (all in the JSON)")
    print("-" * len(head))
    print(line(f"all, {summary['processes']} process(es)", summary["total"]))
    print(
        f"programs compiled in more than one process: {summary['programs_in_more_than_one_process']}, "
        f"{summary['their_compile_cpu_s_beyond_one_process']:.1f} compile CPU s beyond one "
        "process's"
    )
    alike = summary["structures"]
    print(
        f"programs that differ from another only in shapes and constants: "
        f"{alike['programs_sharing_a_structure']} of {alike['programs']} ({alike['structures']} "
        f"structures), {alike['their_compile_cpu_s_beyond_one_per_structure']:.1f} compile CPU s "
        "beyond the cheapest of each structure"
    )
    total = summary["total"]
    print(
        f"compiles under {_SMALL_S * 1000:.0f} ms: {total.get('small_compiles', 0)} of "
        f"{total.get('compiles', 0)}, {total.get('small_compile_cpu_s', 0):.1f} of "
        f"{total.get('compile_cpu_s', 0):.1f} compile CPU s"
    )
    print()
    print_names(summary, top)


def print_names(summary: dict, top: int) -> None:
    """The compile CPU seconds by program name, costliest first."""
    all_s = summary["total"].get("compile_cpu_s", 0.0) or 1.0
    head = (
        f"{'program name':32s} {'compiles':>8s} {'programs':>8s} {'structs':>7s} {'alike s':>7s} "
        f"{'XLA CPU s':>9s} {'share':>6s} {'files':>5s}  costliest file"
    )
    print(head)
    print("-" * len(head))
    for name, row in list(summary["names"].items())[:top]:
        print(
            f"{name[:32]:32s} {row['compiles']:8d} {row['programs']:8d} {row['structures']:7d} "
            f"{row['their_compile_cpu_s_beyond_one_per_structure']:7.1f} "
            f"{row['compile_cpu_s']:9.1f} {row['compile_cpu_s'] / all_s:6.1%} {row['files']:5d}  "
            f"{row['costliest_file']}"
        )
    rest = len(summary["names"]) - top
    if rest > 0:
        print(f"... {rest} more names (all in the JSON)")


def _write_json_atomic(path: pathlib.Path, payload: dict) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to pytest (default: -n 2 tests).",
    )
    parser.add_argument("--out", default="benchmarks/results/suite_compile.json")
    parser.add_argument(
        "--top", type=int, default=25, help="rows of each printed table (files, program names)"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = ["-n", "2", "tests"]
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be 1 or more, got {args.top}")
    here = pathlib.Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="suite-compile-") as folder:
        env = dict(os.environ)
        env[_OUT_VAR] = folder
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "pytest", "-p", "suite_compile", *pytest_args]
        print("running:", " ".join(command), flush=True)
        result = subprocess.run(command, env=env)
        records = {
            p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(folder).glob("*.json"))
        }
    records = {p: r for p, r in records.items() if r["tests"] or r["compiles"]}
    if not records:
        print(
            f"pytest (exit {result.returncode}) ran no test: nothing to summarize", file=sys.stderr
        )
        return result.returncode or 1
    summary = summarize(records)
    summary["pytest_args"] = pytest_args
    summary["pytest_exit"] = result.returncode
    print()
    print_table(summary, args.top)
    _write_json_atomic(pathlib.Path(args.out), summary)
    print(f"wrote {args.out}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
