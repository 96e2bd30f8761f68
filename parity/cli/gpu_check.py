"""The one GPU check: every GPU figure the project quotes, in one call of at most 8 minutes.

``bash scripts/gpu_checks.sh OUT`` runs the stages below one after the other, each in its own
process under its own time cap (a slow stage cannot eat the rest), and writes ``OUT/gpu_check.json``
(each stage's command, exit status, seconds, and the figures read back from its files) and
``OUT/gpu_check.log`` (every stage's output). It needs what a CUDA image has (CUDA torch, JAX with
CUDA, flax, optax) plus jmp and this checkout.

Stages, most important first, with their caps in seconds (each with a key for ``--only`` and
``--cap``): the machine (``machine``, 10: versions); the ``gpt2-small`` cell at fp32, bf16-mixed
and fp16-mixed (``gpt2-fp32`` 120, ``gpt2-bf16-mixed`` 90, ``gpt2-fp16-mixed`` 90: 30 steps,
alternating speed blocks); ``parity matmul`` at 1024/4096/8192 in fp32, bf16 and fp16 (``matmul``,
20); ``benchmarks/bench_loss_scaled.py`` against Flax and jmp (``loss-scaled``, 60); jaxamp's test
files under ``JAX_PLATFORMS=cuda,cpu`` (``jaxamp-tests``, 85: the GPU is the default device; the
CPU backend is there for host callbacks). Together 475 s, within ``BUDGET_S`` (8 minutes). One
stage is outside the plan and runs only when ``--only`` names it: the bf16-mixed cell again under
``--torch-compile`` (``gpt2-compile``, 45).
From the cells it reports, per framework, the bf16-mixed/fp32 and fp16-mixed/fp32 step-time
speed-ups, the JAX/torch figure of each precision (eager and torch.compile), allocator peaks and
each cell's verdict; from the tests, the counts and the names of any that failed; from the
benchmark, each loss-scaled step's ratio to the peers'.

A stage that nears its cap is interrupted (SIGINT to its process group, so pytest and the
cells' phase trace report how far they got), and killed at its cap: no stage runs past its cap. The cells run with
``PARITY_PHASE_TRACE=1``: the log says which phase each was in.

``--dry`` (CPU, CI): every stage's command is built and parsed (the command line's own parser,
a script's ``--help``, pytest's collection), the first cell runs one step of ``gpt2-small``
shrunk to one layer 24 wide (its 12 heads, 2 wide each) at context 8 on CPU in its own process:
the cell's script paths, at the cost of its compile and not of GPT-2's width. The machine stage,
the matmul (at n=64) and the benchmark's ``--help`` run in the check's own process (it has loaded
what they load), and the figures are read back, so the plan cannot rot where no GPU is lent.

    bash scripts/gpu_checks.sh OUT          # on the GPU machine
    bash scripts/gpu_checks.sh --dry OUT    # anywhere: the plan, checked
    bash scripts/gpu_checks.sh OUT --only gpt2-fp32 jaxamp-tests --cap jaxamp-tests=150
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import difflib
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from parity.cli.commands import build_parser
from parity.cli.commands import main as parity_main
from parity.core.records import load_results, run_label
from parity.perf import speed

__all__ = [
    "BUDGET_S",
    "DRY_CAP_S",
    "Stage",
    "format_figures",
    "main",
    "plan",
    "select",
    "summarise",
]

# Every planned stage's cap together: at most 8 minutes, in one device call. Each stage ends
# within its cap (interrupted INTERRUPT_GRACE_S before it, killed at it).
BUDGET_S = 480
# The dry mode's cap per stage: a shared CPU is no GPU, and the caps are the GPU plan's.
DRY_CAP_S = 900
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
JAXAMP_TESTS = ("tests/jaxamp",)
# Test processes on the GPU machine (16 cores): one GPU shared, no preallocation.
TEST_WORKERS = 12
# The loss-scaled benchmark's variants on GPU: the reference, jaxamp's two forms and the peers.
LOSS_SCALED_VARIANTS = ("loss_scaled", "flax", "jmp")
INTERRUPT_GRACE_S = 15
_ENV = (
    "import platform, jax, flax, optax, jmp, numpy, torch; "
    "print('python', platform.python_version(), '| jax', jax.__version__, jax.devices(), "
    "'| flax', flax.__version__, '| optax', optax.__version__, '| jmp', jmp.__version__, "
    "'| numpy', numpy.__version__, '| torch', torch.__version__, "
    "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: its name, command, time cap (seconds) and extra environment."""

    name: str
    command: tuple[str, ...]
    cap_s: int
    env: tuple[tuple[str, str], ...] = ()
    key: str = ""
    # outside the plan's budget: runs only when --only names it (the dry mode parses it too)
    extra: bool = False


def _cell(out: Path, precision: str, *, dry: bool, compiled: bool = False) -> tuple[str, ...]:
    folder = out / ("gpt2_compile" if compiled else "gpt2")
    cmd = ["-m", "parity", "run", "--model", "transformer", "--size", "gpt2-small"]
    cmd += ["--precision", precision, "--no-eval", "--no-plots", "--no-progress"]
    cmd += ["--out", str(folder)]
    # the phase trace on stderr: a cell stopped at its cap still says where its time went

    if dry:
        cmd += ["--device", "cpu", "--steps", "1", "--batch-size", "2", "--speed-blocks", "0"]
        # the size's heads and vocabulary; its width, depth and context shrunk
        for override in ("seq_len=8", "num_layers=1", "d_model=24"):
            cmd += ["--model-override", override]
    else:
        cmd += ["--device", "gpu", "--steps", "30", "--batch-size", "8", "--speed-blocks", "4"]
    if compiled:
        cmd.append("--torch-compile")
    return (sys.executable, *cmd)


def _cells_env(out: Path) -> tuple[tuple[str, str], ...]:
    """The cells' environment: the phase trace, and one JAX compilation cache for all of them
    (the layer probe's program and bf16/fp16's float32 stage of step 0 are the fp32 cell's)."""
    return (
        ("PARITY_PHASE_TRACE", "1"),
        ("PYTHONUNBUFFERED", "1"),
        ("JAX_COMPILATION_CACHE_DIR", str(out / "jax_cache")),
    )


def plan(out: Path, *, dry: bool = False, tests: tuple[str, ...] = JAXAMP_TESTS) -> list[Stage]:
    """The stages, in order, with their caps (the planned ones together at most `BUDGET_S`;
    an ``extra`` stage runs only when named); `tests`: what the jaxamp tests stage runs (pytest
    paths or node ids)."""
    py = sys.executable
    device = "cpu" if dry else "gpu"
    sizes = ["64"] if dry else ["1024", "4096", "8192"]
    # Most important first: a call that runs out of time loses the last stages.
    stages = [Stage("machine", (py, "-c", _ENV), 10, key="machine")]
    caps = {"fp32": 120, "bf16-mixed": 90, "fp16-mixed": 90}
    stages += [
        Stage(f"gpt2-small {p}", _cell(out, p, dry=dry), caps[p], _cells_env(out), key=f"gpt2-{p}")
        for p in PRECISIONS
    ]
    stages.append(
        Stage(
            "matmul",
            (py, "-m", "parity", "matmul", "--device", device, "--sizes", *sizes, "--dtypes")
            + ("fp32", "bf16", "fp16", "--out", str(out / "matmul"), "--quiet"),
            20,
            key="matmul",
        )
    )
    stages.append(
        Stage(
            "bench_loss_scaled",
            (py, "benchmarks/bench_loss_scaled.py", "--out", str(out / "loss_scaled.json"))
            + ("--variants", *LOSS_SCALED_VARIANTS),
            60,
            (("PYTHONUNBUFFERED", "1"),),
            key="loss-scaled",
        )
    )
    # -v: each test's outcome is in the log as it ends (pytest's JUnit file is written at the end
    # only, and a stage stopped at its cap leaves none)
    workers = () if dry else ("-n", str(TEST_WORKERS))
    stages.append(
        Stage(
            "jaxamp tests (JAX_PLATFORMS=cuda,cpu)",
            (py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE")
            + ("--strict-markers", "--junitxml", str(out / "jaxamp_tests.xml"))
            + workers
            + tuple(tests),
            85,
            (("JAX_PLATFORMS", "cpu" if dry else "cuda,cpu"),),
            key="jaxamp-tests",
        )
    )
    stages.append(
        Stage(
            "gpt2-small bf16-mixed torch.compile",
            _cell(out, "bf16-mixed", dry=dry, compiled=True),
            45,
            _cells_env(out),
            key="gpt2-compile",
            extra=True,
        )
    )
    return stages


def select(
    stages: list[Stage],
    only: list[str] | None = None,
    caps: list[str] | None = None,
    *,
    extras: bool = False,
) -> list[Stage]:
    """The stages whose keys `only` names (when None: the planned ones, and the ``extra`` ones
    too when `extras`), with the caps `caps` sets (``KEY=SECONDS``); an unknown key or a
    malformed cap is refused, naming the closest key."""
    keys = [s.key for s in stages]

    def known(key: str, what: str) -> str:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{what} names stage {key!r}; the stages are {keys}{hint}")
        return key

    if only is None:
        chosen = {s.key for s in stages if extras or not s.extra}
    else:
        chosen = {known(k, "--only") for k in only}
    override: dict[str, int] = {}
    for item in caps or []:
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit() or int(value) <= 0:
            raise ValueError(f"--cap takes KEY=SECONDS (a positive whole number); got {item!r}")
        override[known(key, "--cap")] = int(value)
    return [
        dataclasses.replace(s, cap_s=override.get(s.key, s.cap_s))
        for s in stages
        if s.key in chosen
    ]


def _dry_command(stage: Stage, run_it: bool) -> tuple[str, ...] | None:
    """What the dry mode runs for `stage`: the stage itself (`run_it`: the matmul at n=64, the
    first cell shrunk), a parse of it (a script's ``--help``, pytest's collection), or None (a
    ``python -m parity`` command parsed in this process)."""
    args = list(stage.command[1:])
    if args[:2] == ["-m", "parity"]:
        return stage.command if run_it else None
    if args[:2] == ["-m", "pytest"]:
        # the options as the GPU runs them, on one test file of each folder named: the options
        # and a collection are checked (the whole folder's collection is the suite's own)
        rest = [_one_test_file(a) for a in args[2:]]
        return (*stage.command[:3], "--collect-only", *rest)
    if args and args[0].endswith(".py"):
        return (stage.command[0], args[0], "--help")
    return stage.command


def _one_test_file(arg: str) -> str:
    """`arg`, or the first ``test_*.py`` of it when it is a folder."""
    folder = Path(arg)
    if not folder.is_dir():
        return arg
    return str(min(folder.glob("test_*.py"), default=folder))


def _parse_parity(stage: Stage) -> None:
    """Parses a ``python -m parity`` stage with the command line's own parser (SystemExit on
    a bad argument, as the real run would)."""
    build_parser().parse_args(list(stage.command[3:]))


def _parsed(stage: Stage) -> dict[str, Any]:
    try:
        _parse_parity(stage)
        rc = 0
    except SystemExit as e:  # argparse's refusal
        rc = int(e.code or 0) or 2
    return {
        "stage": stage.name,
        "command": " ".join(stage.command),
        "cap_s": stage.cap_s,
        "rc": rc,
        "timed_out": False,
        "seconds": 0.0,
        "dry": "parsed",
    }


def run_stage(
    stage: Stage, log, *, command: tuple[str, ...] | None = None, cap_s: int | None = None
) -> dict[str, Any]:
    """Runs one stage under its cap (or `cap_s`); its output goes to `log`. Never raises."""
    command = command or stage.command
    if cap_s is not None:
        stage = dataclasses.replace(stage, cap_s=cap_s)
    log.write(f"\n== {stage.name} (cap {stage.cap_s} s): {' '.join(command)}\n")
    log.flush()
    start = time.perf_counter()
    env = {**os.environ, **dict(stage.env)}
    # its own process group: at the cap the stage and its children (pytest's workers) are
    # interrupted together, so each reports how far it got, and killed if they do not stop
    child = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    timed_out = False
    # the interruption's grace is inside the cap: the stage never runs past it
    grace = min(INTERRUPT_GRACE_S, stage.cap_s / 4)
    try:
        rc = child.wait(timeout=stage.cap_s - grace)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(child.pid, signal.SIGINT)
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        rc = 124
    return _finished(stage, command, log, rc=rc, timed_out=timed_out, start=start)


def _finished(
    stage: Stage, command, log, *, rc: int, timed_out: bool, start: float
) -> dict[str, Any]:
    """A stage's result (its last log line written): its name, command, cap, exit status, whether
    the cap stopped it, and its seconds since `start`."""
    seconds = time.perf_counter() - start
    log.write(
        f"== {stage.name}: rc={rc}{' (cap reached)' if timed_out else ''} in {seconds:.0f} s\n"
    )
    log.flush()
    return {
        "stage": stage.name,
        "command": " ".join(command),
        "cap_s": stage.cap_s,
        "rc": rc,
        "timed_out": timed_out,
        "seconds": round(seconds, 1),
    }


def _runs_in_process(command: tuple[str, ...]) -> bool:
    """Whether the dry mode runs `command` in this process: ``python -c CODE``, a script's
    ``--help``, or a ``python -m parity`` command other than a cell (the cell runs in its own
    process, with its environment: the phase trace and the cells' compilation cache)."""
    args = command[1:]
    return (
        args[:1] == ("-c",)
        or (args[:2] == ("-m", "parity") and args[2:3] != ("run",))
        or (args[:1] != () and args[0].endswith(".py") and args[1:] == ("--help",))
    )


def run_in_process(stage: Stage, log, *, command: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The dry mode's run of `command` (default the stage's; a `_runs_in_process` one) here: the
    code, the script (as ``__main__``, with its arguments in ``sys.argv``), or the command
    line's `parity.cli.commands.main` on its arguments, with the stage's environment and its
    output in `log` (the environment and ``sys.argv`` are restored after). Never raises: an
    exception is rc 1, its traceback in `log`."""
    command = command or stage.command
    log.write(f"\n== {stage.name} (in this process): {' '.join(command)}\n")
    log.flush()
    start = time.perf_counter()
    environ, argv = dict(os.environ), sys.argv
    os.environ.update(dict(stage.env))
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            if command[1] == "-c":
                exec(compile(command[2], f"<{stage.key}>", "exec"), {"__name__": "__main__"})
                rc = 0
            elif command[1:3] == ("-m", "parity"):
                rc = parity_main(list(command[3:]))
            else:
                sys.argv = list(command[1:])
                runpy.run_path(command[1], run_name="__main__")
                rc = 0
    except SystemExit as e:  # argparse's refusal or --help, or the code's own exit
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    except Exception:
        traceback.print_exc(file=log)
        rc = 1
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = argv
    return _finished(stage, command, log, rc=rc, timed_out=False, start=start) | {
        "in_process": True
    }


def _median(run: dict[str, Any]) -> float | None:
    return (run.get("summary") or {}).get("step_time_median_s")


def summarise(out: Path) -> dict[str, Any]:
    """The figures the stages left in `out`: matmul cases, and per gpt2-small cell the verdict,
    each framework's median step time and allocator peak, the JAX/torch speed figure, and the
    low-precision speed-ups over fp32 per framework."""
    figures: dict[str, Any] = {}
    matmul = out / "matmul" / "matmul.json"
    if matmul.exists():
        figures["matmul"] = json.loads(matmul.read_text())
    cells: dict[str, Any] = {}
    medians: dict[str, dict[str, float]] = {}
    for folder in ("gpt2", "gpt2_compile"):
        if not (out / folder / "results.json").exists():
            continue
        runs = [r for r in load_results(out / folder)["runs"] if not r.get("variant")]
        verdicts = out / folder / "verdicts.json"
        status = json.loads(verdicts.read_text())["status"] if verdicts.exists() else None
        for key, members in speed.cells(runs).items():
            precision = key[1]
            cell = cells.setdefault(f"{folder} {precision}", {"status": status, "runs": {}})
            for label, run in members.items():
                summary = run.get("summary") or {}
                cell["runs"][label] = {
                    "median_step_s": _median(run),
                    "peak_memory_bytes": summary.get("peak_memory_bytes"),
                    "peak_memory_method": summary.get("peak_memory_method"),
                }
                if _median(run):
                    medians.setdefault(run_label(run), {})[precision] = _median(run)
            reference = speed.torch_reference(members)
            for label in speed.jax_labels(members):
                if reference is not None:
                    figure = speed.speed_figure(members[label], reference[1])
                    cell[f"{label} vs {reference[0]}"] = {
                        "status": figure["status"],
                        "text": figure["text"],
                    }
    speedups = {
        label: {
            f"{p}/fp32": by[p] and by["fp32"] / by[p]
            for p in PRECISIONS[1:]
            if p in by and "fp32" in by
        }
        for label, by in medians.items()
    }
    figures["gpt2_small"] = {"cells": cells, "speedup_over_fp32": speedups}
    tests = _junit(out / "jaxamp_tests.xml")
    if tests is None and (out / "gpu_check.log").exists():
        tests = _tests_in_log((out / "gpu_check.log").read_text(errors="replace"))
    if tests is not None:
        figures["jaxamp_tests"] = tests
    loss_scaled = out / "loss_scaled.json"
    if loss_scaled.exists():
        figures["loss_scaled"] = _loss_scaled(json.loads(loss_scaled.read_text()))
    return figures


def _junit(path: Path) -> dict[str, Any] | None:
    """pytest's JUnit XML as counts, the failed tests (name and first line of the message) and
    the skip reasons with their counts; None when there is no file (the stage did not end)."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    skips: dict[str, int] = {}
    for suite in suites:
        for field in counts:
            counts[field] += int(suite.get(field, 0))
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            for tag in ("failure", "error"):
                for bad in case.iter(tag):
                    message = (bad.get("message") or "").strip().splitlines()
                    failed.append(f"{name}: {message[0][:200] if message else tag}")
            for skip in case.iter("skipped"):
                reason = (skip.get("message") or "").strip()[:160]
                skips[reason] = skips.get(reason, 0) + 1
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "skip_reasons": skips}


_OUTCOME = re.compile(
    r"^(?:\[gw\d+\] \[\s*\d+%\] (?P<a>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (?P<ida>\S+)"
    r"|(?P<idb>tests/\S+::\S+) (?P<b>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS))"
)


def _tests_in_log(text: str) -> dict[str, Any] | None:
    """The tests stage's outcomes read from its verbose lines in the log (a stage stopped at its
    cap writes no JUnit file): counts, the failed ids, ``"complete": False``; None if none."""
    section = text.split("== jaxamp tests", 1)[-1] if "== jaxamp tests" in text else ""
    outcomes: dict[str, str] = {}
    for line in section.splitlines():
        found = _OUTCOME.match(line.strip())
        if found:
            outcomes[found["ida"] or found["idb"]] = found["a"] or found["b"]
    if not outcomes:
        return None
    count = collections.Counter(outcomes.values())
    return {
        "tests": len(outcomes),
        "failures": count["FAILED"] + count["XPASS"],
        "errors": count["ERROR"],
        "skipped": count["SKIPPED"] + count["XFAIL"],
        "passed": count["PASSED"],
        "failed": [i for i, o in outcomes.items() if o in ("FAILED", "ERROR", "XPASS")],
        "skip_reasons": {},
        "complete": False,
    }


def _loss_scaled(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model, policy and donation: each jaxamp variant's ratio to plain and to each peer."""
    rows = []
    for r in payload.get("results", []):
        for variant, v in r["variants"].items():
            if not variant.startswith("loss_scaled"):
                continue
            rows.append(
                {
                    "model": r["model"],
                    "policy": r["policy"],
                    "donated": r["donated"],
                    "variant": variant,
                    "ratio_to_plain": v["ratio_to_plain"],
                    "ratio_to_peer": v.get("ratio_to_peer", {}),
                }
            )
    return rows


def format_figures(figures: dict[str, Any]) -> str:
    """The figures as short tables (what the check prints last): matmul TFLOP/s, each gpt2-small
    cell's verdict, step times, allocator peaks and JAX/torch figure, the speed-ups over fp32,
    the loss-scaled step against the peers, and the tests' counts with the failed ones."""
    lines: list[str] = []
    matmul = (figures.get("matmul") or {}).get("results") or []
    if matmul:
        lines.append("matmul TFLOP/s (median [95% CI]):")
        for r in matmul:
            lo, hi = r.get("tflops_ci") or (None, None)
            ci = f" [{lo:.3g}, {hi:.3g}]" if lo is not None else ""
            lines.append(
                f"  {r['framework']:<6}{r['dtype']:<6}n={r['n']:<6}"
                + (f"{r['tflops']:.4g}{ci}" if r.get("tflops") else f"- ({r.get('error')})")
            )
    gpt2 = figures.get("gpt2_small") or {}
    for name, cell in (gpt2.get("cells") or {}).items():
        lines.append(f"{name}: {cell.get('status')}")
        for label, run in cell.get("runs", {}).items():
            median, peak = run.get("median_step_s"), run.get("peak_memory_bytes")
            lines.append(
                f"  {label:<12} step {median * 1e3 if median else float('nan'):.2f} ms, "
                f"peak {peak / 2**30 if peak else float('nan'):.2f} GiB "
                f"({run.get('peak_memory_method')})"
            )
        for key, value in cell.items():
            if " vs " in key:
                lines.append(f"  {key}: {value['text']}")
    for label, ups in (gpt2.get("speedup_over_fp32") or {}).items():
        if ups:
            text = ", ".join(f"{k} {v:.2f}x" for k, v in ups.items() if v)
            lines.append(f"speed-up over fp32 ({label}, median step times): {text}")
    rows = figures.get("loss_scaled") or []
    if rows:
        lines.append("loss-scaled step / plain step, and / each peer's (paired 95% CI):")
        for r in rows:
            peers = "  ".join(
                f"/{peer} {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
                for peer, c in r["ratio_to_peer"].items()
            )
            donated = "donated" if r["donated"] else "not donated"
            lines.append(
                f"  {r['model']:<12}{r['policy']:<11}{donated:<12}{r['variant']:<22}"
                f"{r['ratio_to_plain']:.3f}  {peers}"
            )
    tests = figures.get("jaxamp_tests")
    if tests:
        lines.append(
            f"jaxamp tests: {tests['passed']} passed, {tests['failures']} failed, "
            f"{tests['errors']} errors, {tests['skipped']} skipped"
        )
        lines += [f"  FAILED {name}" for name in tests["failed"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the one GPU check (see the module docstring)")
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and its log")
    parser.add_argument("--dry", action="store_true", help="CPU: parse every stage, run one step")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="run only these stages")
    parser.add_argument(
        "--cap", nargs="+", metavar="KEY=SECONDS", default=[], help="another cap for a stage"
    )
    parser.add_argument(
        "--tests-from",
        metavar="FILE",
        help="the jaxamp tests stage runs these pytest node ids (one a line), not tests/jaxamp",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = JAXAMP_TESTS
    if args.tests_from:
        try:
            tests = tuple(line.strip() for line in open(args.tests_from) if line.strip())
        except OSError as e:
            parser.error(f"--tests-from {args.tests_from!r}: {e.strerror}")
        if not tests:
            parser.error(f"--tests-from {args.tests_from!r} names no test")
    try:
        # the dry mode checks the extra stages' commands too
        stages = select(plan(out, dry=args.dry, tests=tests), args.only, args.cap, extras=args.dry)
    except ValueError as e:
        parser.error(str(e))
    results: list[dict[str, Any]] = []

    def write() -> None:
        # after every stage: a call stopped part-way keeps the stages that ended
        report = {
            "dry": args.dry,
            "budget_s": BUDGET_S,
            "caps_s": sum(s.cap_s for s in stages),
            "stages": results,
            "figures": summarise(out),
        }
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        os.replace(tmp, out / "gpu_check.json")

    with open(out / "gpu_check.log", "w") as log:
        cell_ran = False
        for stage in stages:
            if not args.dry:
                results.append(run_stage(stage, log))
                write()
                continue
            is_cell = "run" in stage.command[3:4]
            command = _dry_command(stage, run_it=not (is_cell and cell_ran))
            cell_ran = cell_ran or is_cell
            if command is None:
                results.append(_parsed(stage))
                log.write(f"\n== {stage.name}: {' '.join(stage.command)}\n")
                log.write(f"== {stage.name}: parsed, rc={results[-1]['rc']}\n")
            elif _runs_in_process(command):
                dry = "ran" if command is stage.command else "parsed"
                results.append(run_in_process(stage, log, command=command) | {"dry": dry})
            elif command is stage.command:
                results.append(run_stage(stage, log, cap_s=DRY_CAP_S) | {"dry": "ran"})
            else:
                parsed = run_stage(stage, log, command=command, cap_s=DRY_CAP_S)
                results.append(parsed | {"dry": "parsed"})
            write()
    write()
    print(format_figures(summarise(out)))
    failed = [r["stage"] for r in results if r["rc"] != 0]
    print(
        f"gpu check{' (dry)' if args.dry else ''}: {len(results) - len(failed)}/{len(results)} "
        f"stages ok{'; failed: ' + ', '.join(failed) if failed else ''}; {out / 'gpu_check.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
