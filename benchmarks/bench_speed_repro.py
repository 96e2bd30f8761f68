"""Do speed figures reproduce? The same `parity run` several times; each run's alternating-block
verdict side by side.

Runs ``python -m parity run --model transformer --precision fp32 --steps 40 --batch-size 8``
(the built-in transformer at fp32, the command that once gave "JAX faster" with the intervals
4.97-7.36, 64.85-76.66 and 66.34-78.11 three times in a row) `--repeats` times, each in a fresh
process as a user runs it, and reads each run's alternating-block timing (``speed_blocks``:
`parity.training.blocks`, judged by `parity.perf.speed.blocks_verdict`). It prints one row per run (the verdict
word, the ratio and its 95% interval, the ratios by round, the cores other processes used while the
blocks ran, the load before, the threads) and one conclusion:

- ``REPRODUCED``: every run gave a ratio, all with the same verdict word ("faster", "slower" or "no
  clear difference") and every two intervals overlap;
- ``NOT REPRODUCIBLE HERE``: some run withheld its ratio because its rounds disagreed, or runs gave
  different words or disjoint intervals;
- ``REFUSED``: some run refused a ratio (the machine was oversubscribed, with the measured reason)
  and the others agree: the machine cannot give the figure now.

Not a timed test: a benchmark to run on the machine whose figures are to be quoted.

    python benchmarks/bench_speed_repro.py --out benchmarks/results/speed_repro.json
    python benchmarks/bench_speed_repro.py --threads 1 --repeats 5 --out /tmp/repro.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.core.hardware import hardware_summary  # noqa: E402
from parity.core.records import load_results, write_json_atomic  # noqa: E402
from parity.perf.speed import blocks_verdict  # noqa: E402

COMMAND = ["--model", "transformer", "--precision", "fp32", "--steps", "40", "--batch-size", "8"]


def verdict_word(verdict: dict) -> str:
    """ "faster" / "slower" / "no clear difference" for a ratio, else the status.

    Example:
      >>> verdict_word({"status": "ratio", "ratio": 0.5, "low": 0.4, "high": 0.6})
      'faster'
    """
    if verdict["status"] != "ratio":
        return verdict["status"]
    if verdict["low"] <= 1.0 <= verdict["high"]:
        return "no clear difference"
    return "slower" if verdict["ratio"] > 1 else "faster"


def conclusion(verdicts: list[dict]) -> tuple[str, str]:
    """The runs' joint conclusion and why (see the module docstring).

    Example:
      >>> ok = {"status": "ratio", "ratio": 0.5, "low": 0.4, "high": 0.6}
      >>> conclusion([ok, {**ok, "low": 0.45, "high": 0.65}])[0]
      'REPRODUCED'
      >>> conclusion([ok, {**ok, "ratio": 0.8, "low": 0.7, "high": 0.9}])[0]
      'NOT REPRODUCIBLE HERE'
    """
    statuses = [v["status"] for v in verdicts]
    if "not reproducible" in statuses:
        count = statuses.count("not reproducible")
        return "NOT REPRODUCIBLE HERE", f"{count} of {len(verdicts)} runs' rounds disagreed"
    ratios = [v for v in verdicts if v["status"] == "ratio"]
    words = sorted({verdict_word(v) for v in ratios})
    if len(words) > 1:
        return "NOT REPRODUCIBLE HERE", f"the runs' verdict words differ: {', '.join(words)}"
    disjoint = [
        (i, j)
        for i, a in enumerate(ratios)
        for j, b in enumerate(ratios)
        if i < j and (a["high"] < b["low"] or b["high"] < a["low"])
    ]
    if disjoint:
        return "NOT REPRODUCIBLE HERE", f"{len(disjoint)} pairs of runs have disjoint intervals"
    if "refused" in statuses:
        reasons = sorted({v["reason"] for v in verdicts if v["status"] == "refused"})
        return "REFUSED", f"{statuses.count('refused')} of {len(verdicts)} runs: " + "; ".join(
            reasons[:2]
        )
    return "REPRODUCED", f"{len(ratios)} runs: '{words[0]}', every two intervals overlap"


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def run_once(index: int, folder: Path, args) -> dict:
    out = folder / f"run{index}"
    command = [sys.executable, "-m", "parity", "run", *COMMAND, "--out", str(out), "--no-progress"]
    command += ["--speed-blocks", str(args.blocks)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    started, load_before = time.time(), _load()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    runs = load_results(out)["runs"] if (out / "results.json").exists() else []
    trial = next((r["speed_blocks"] for r in runs if r.get("speed_blocks")), None)
    if trial is None:
        raise RuntimeError(
            f"run {index}: no alternating-block timing (exit {done.returncode}):\n"
            + done.stderr[-2000:]
        )
    verdict = blocks_verdict(trial)
    hardware = next(r["hardware"] for r in runs if r.get("hardware"))
    return {
        "run": index,
        "exit_code": done.returncode,
        "wall_s": time.time() - started,
        "load_average_before_run": load_before,
        "verdict": verdict,
        "word": verdict_word(verdict),
        "speed_blocks": trial,
        "hardware": hardware_summary(hardware),
    }


def _row(result: dict) -> str:
    verdict, trial = result["verdict"], result["speed_blocks"]
    threads = trial.get("threads") or {}
    figure = (
        f"{verdict['ratio']:.3f} ({verdict['low']:.3f}-{verdict['high']:.3f})"
        if verdict["status"] == "ratio"
        else verdict["reason"] or ""
    )
    others = trial.get("others_cpu_cores_total")
    return (
        f"| {result['run']} | {result['word']} | {figure} "
        f"| {min(verdict['block_ratios']):.2f}-{max(verdict['block_ratios']):.2f} "
        f"| {'—' if others is None else f'{others:.2f}'} "
        f"| {(trial.get('load_average_before') or ['—'])[0]} "
        f"| {threads.get('torch_intra_op_threads')}/{threads.get('xla_cpu_intra_op_threads')} |"
    )


def render(record: dict) -> str:
    lines = [
        f"`python -m parity run {' '.join(COMMAND)}` x {len(record['results'])}",
        "",
        "| run | verdict | JAX / torch (95% CI) or reason | round ratios | others' CPU (cores) "
        "| load before | threads torch/XLA |",
        "|---|---|---|---|---|---|---|",
        *(_row(r) for r in record["results"]),
        "",
        f"**{record['conclusion']}**: {record['why']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="identical runs (default 5)")
    parser.add_argument("--blocks", type=int, default=6, help="--speed-blocks of each run")
    parser.add_argument("--threads", type=int, default=None, help="--threads of each run")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    parser.add_argument("--out", default=None, help="JSON file for the record")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error(f"--repeats must be >= 2 (a reproduction needs two runs); got {args.repeats}")
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        results = []
        for index in range(args.repeats):
            results.append(run_once(index, Path(folder), args))
            print(_row(results[-1]), flush=True)
    verdict, why = conclusion([r["verdict"] for r in results])
    record = {
        "benchmark": "speed_repro",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "-m", "parity", "run", *COMMAND],
        "args": vars(args),
        "wall_s": time.time() - started,
        "conclusion": verdict,
        "why": why,
        "results": results,
    }
    print(render(record))
    if args.out:
        write_json_atomic(args.out, record)
        print(f"results: {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
