"""Multi-device parity runs: torch DDP/FSDP2 ranks vs JAX jit / shard_map / multi-process.

`run_distributed` is one cell (`parity.cell.run_cell`: the step-0 gate, then training) whose
training starts every worker (`parity.distributed.worker`) as a process it owns (`WorkerGroup`:
bounded by a timeout, ended by PID on success, failure and Ctrl-C), forked by one process per run
that imported the workers' modules once (`parity.distributed.zygote`). Each side
(torch, each JAX mode) is one run record, labelled ``"torch ddp"``, ``"jax:jit ddp"``...; the one
writer (`parity.cell.write_outputs`) judges them as every cell is judged (`compare_runs` pairs
torch with each JAX mode of the arm, `parity.verdicts.judge` judges them: PASS, FAIL or
INCONCLUSIVE) and writes ``results.json``, ``verdicts.json`` and ``report.md``. The arm's own
checks are rows stored with the sides (``distributed_verdicts``), judged with the others:

- loss-scale trajectory and skip decisions identical across the ranks of each side;
- an injected non-finite gradient on one rank (fp16) skipped on every rank, on both sides;
- replicated parameters bit-identical across ranks (torch ranks, JAX devices and processes);
- the gradient-reduction dtype on each side equal to the policy's ``reduce_dtype`` (torch: DDP
  bucket dtype / FSDP2 reduction dtype; JAX: the post-SPMD HLO's all-reduce/reduce-scatter);
- a JAX mode the recipe cannot run: "unsupported here" with the reason (never another precision).

``distributed.json`` adds what is per rank (each rank's steps, digests and collectives); step
time and memory per device are reported with their methods (not judged).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from parity.cell import run_cell, write_outputs
from parity.core.config import RunConfig
from parity.core.hardware import UnsupportedHere
from parity.core.records import build_error_record, build_run_record, write_json_atomic
from parity.distributed.pairs import make_pair
from parity.distributed.procs import WorkerError, WorkerGroup, forking, free_port
from parity.perf import measure
from parity.report.markdown import speed_ratios
from parity.verdicts.outcomes import cell_configs, format_verdicts
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict, cell_fields

__all__ = [
    "JAX_MODES",
    "STRATEGIES",
    "DistributedPlan",
    "DistributedResult",
    "format_distributed",
    "run_distributed",
]

STRATEGIES = ("ddp", "fsdp")
JAX_MODES = ("jit", "shard_map", "multiprocess")


def _closest(value: Any, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


@dataclasses.dataclass(frozen=True)
class DistributedPlan:
    """How a distributed parity run is laid out.

    Attributes:
      devices: JAX devices (mesh size; processes in ``"multiprocess"`` mode), 1..64.
      strategy: ``"ddp"`` (torch DDP + autocast vs JAX data-parallel: replicated params, sharded
        batch, jaxamp.autocast) or ``"fsdp"`` (torch FSDP2 ``fully_shard`` with
        ``MixedPrecisionPolicy`` vs JAX params sharded along the mesh axis, jaxamp policy casts).
      torch_ranks: torch processes (default: `devices`); the global batch is split among them.
      jax_modes: any of ``"jit"``, ``"shard_map"``, ``"multiprocess"``.
      inject_overflow: ``(step, rank)``: that rank's logits are multiplied by inf at that step on
        both sides (a non-finite gradient on one rank), or None.
      timeout_s: wall-clock bound of each worker group (all ranks of one side/mode).
      torch_backend: ``"gloo"`` (CPU) or ``"nccl"`` (one CUDA device per rank).
      jax_platform: ``"cpu"`` (N host devices) or ``"gpu"``.

    Examples:
      >>> DistributedPlan(devices=2, strategy="ddp").jax_modes
      ('jit', 'shard_map', 'multiprocess')
    """

    devices: int = 2
    strategy: str = "ddp"
    torch_ranks: int | None = None
    jax_modes: tuple[str, ...] = JAX_MODES
    inject_overflow: tuple[int, int] | None = None
    timeout_s: float = 600.0
    torch_backend: str = "gloo"
    jax_platform: str = "cpu"

    def __post_init__(self):
        for name in ("devices", "torch_ranks"):
            value = getattr(self, name)
            if value is None and name == "torch_ranks":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(
                    f"DistributedPlan: `{name}` must be an integer in 1..64; got {value!r}."
                )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"DistributedPlan: `strategy` must be one of {STRATEGIES}; got "
                f"{self.strategy!r}.{_closest(self.strategy, STRATEGIES)}"
            )
        modes = tuple(self.jax_modes)
        for mode in modes:
            if mode not in JAX_MODES:
                raise ValueError(
                    f"DistributedPlan: `jax_modes` entries must be in {JAX_MODES}; got "
                    f"{mode!r}.{_closest(mode, JAX_MODES)}"
                )
        object.__setattr__(self, "jax_modes", modes)
        if self.torch_backend not in ("gloo", "nccl"):
            raise ValueError(
                "DistributedPlan: `torch_backend` must be 'gloo' or 'nccl'; got "
                f"{self.torch_backend!r}."
            )
        if self.jax_platform not in ("cpu", "gpu"):
            raise ValueError(
                f"DistributedPlan: `jax_platform` must be 'cpu' or 'gpu'; got {self.jax_platform!r}."
            )
        if not isinstance(self.timeout_s, int | float) or self.timeout_s <= 0:
            raise ValueError(f"DistributedPlan: `timeout_s` must be > 0; got {self.timeout_s!r}.")
        if self.inject_overflow is not None:
            step, rank = self.inject_overflow
            if not (isinstance(step, int) and isinstance(rank, int) and step >= 0 and rank >= 0):
                raise ValueError(
                    "DistributedPlan: `inject_overflow` must be (step, rank) with non-negative "
                    f"ints; got {self.inject_overflow!r}."
                )
            if rank >= self.ranks:
                raise ValueError(
                    f"DistributedPlan: inject_overflow rank {rank} must be < the number of "
                    f"torch ranks ({self.ranks})."
                )
            object.__setattr__(self, "inject_overflow", (int(step), int(rank)))

    @property
    def ranks(self) -> int:
        """Torch processes."""
        return self.devices if self.torch_ranks is None else self.torch_ranks


@dataclasses.dataclass
class DistributedResult:
    """Everything one distributed run produced.

    Attributes:
      config, plan: what was run.
      ranks: per-side worker results: ``{"torch": [rank0, ...], "jax:jit": [...], ...}``.
      runs: this run's records (`parity.core.records` schema), one per side/mode.
      verdicts: `parity.verdicts.rows.Verdict` rows of ``results.json`` (`write_outputs`'s).
      status: ``"PASS"``, ``"FAIL"``, ``"INCONCLUSIVE"`` or ``"NOTHING COMPARED"``.
      speed: one JAX/torch speed figure per JAX mode, keyed by the compared pair
        (``"jax:jit ddp vs torch ddp"``: `parity.report.markdown.speed_ratios`, the report's
        bottom line).
    """

    config: RunConfig
    plan: DistributedPlan
    ranks: dict[str, list[dict[str, Any]]]
    runs: list[dict[str, Any]]
    verdicts: list[Any]
    status: str
    speed: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "plan": dataclasses.asdict(self.plan),
            "status": self.status,
            "speed": self.speed,
            "verdicts": [v.to_dict() for v in self.verdicts],
            "ranks": self.ranks,
            "runs": self.runs,
        }


# XLA flags each worker sets itself (its device count, its HLO dump); the caller's others
# (e.g. an optimisation level) reach the workers as they reach the single-device trainers.
_WORKER_XLA_FLAGS = (
    "--xla_force_host_platform_device_count",
    "--xla_dump_to",
    "--xla_dump_hlo_pass_re",
    "--xla_dump_hlo_module_re",
)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = [
        flag
        for flag in env.pop("XLA_FLAGS", "").split()
        if flag.split("=", 1)[0] not in _WORKER_XLA_FLAGS
    ]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _preload(frameworks, strategy: str) -> tuple[str, ...]:
    """What the run's zygote imports once for all its workers: the worker (torch, JAX, the
    harness), and what torch's DDP (``torch._dynamo``, at its construction) or FSDP2 loads."""
    torch_side = ("torch._dynamo",) if strategy == "ddp" else ("torch.distributed.fsdp",)
    return ("parity.distributed.worker", *(torch_side if "torch" in frameworks else ()))


def _run_group(
    name: str, specs: list[dict[str, Any]], timeout_s: float, work: Path, env, zygote
) -> list[dict[str, Any]]:
    with WorkerGroup(timeout_s, log_dir=work / "logs") as group:
        for spec in specs:
            path = work / f"{name}-{spec['rank']}.spec.json"
            path.write_text(json.dumps(spec))
            group.start_forked(
                f"{name.replace(':', '-')}-rank{spec['rank']}",
                zygote,
                "parity.distributed.worker",
                [str(path)],
                env=env,
            )
        group.wait()
    return [json.loads(Path(spec["out"]).read_text()) for spec in specs]


def _labels(side: str, plan: DistributedPlan) -> dict[str, str]:
    """A side's record fields: its label (``"jax:jit ddp"``) and arm (the strategy), which keep
    it apart from the other sides and pair it with them (`parity.core.records.run_label`)."""
    return {"distributed": f"{side} {plan.strategy}", "arm": plan.strategy}


def _record(side: str, config: RunConfig, plan: DistributedPlan, pair, stream, rank0: dict):
    timing = measure.step_time_summary(rank0["times"], config.timing_warmup)
    return build_run_record(
        framework="torch" if side == "torch" else "jax",
        config=config,
        pair=pair,
        stream=stream,
        steps_log=rank0["steps"],
        timing=timing,
        compile_time_s=rank0.get("compile_time_s"),
        compile_method="jax.jit(...).lower(...).compile() wall time" if side != "torch" else None,
        peak_memory=rank0.get("peak_memory_bytes"),
        memory_method=None,
        eval_metric=None,
        stopped_reason=rank0.get("stopped_reason"),
        extra={
            **_labels(side, plan),
            "mixed_precision_method": rank0.get("method"),
            "memory_method_detail": rank0.get("memory_method"),
        },
    )


def run_distributed(
    config: RunConfig,
    plan: DistributedPlan,
    out: str | os.PathLike | None = None,
    *,
    frameworks: tuple[str, ...] = ("torch", "jax"),
    pair_factory: str | None = None,
    step0_checks: bool = True,
    echo: bool = False,
    plots: bool = True,
) -> DistributedResult:
    """Runs the torch side and every JAX mode of `plan` on `config` as one cell; returns verdicts.

    Args:
      config: the run (model, precision, steps, global batch size...). The global batch size
        must divide by the number of ranks and devices.
      plan: the layout (`DistributedPlan`).
      out: folder for ``results.json``, ``verdicts.json``, ``report.md`` (`parity.cell.write_outputs`:
        merged with what the folder holds), ``distributed.json`` (per rank) and the worker logs;
        default a temporary folder.
      frameworks: ``("torch", "jax")`` or one of them.
      pair_factory: ``"package.module:function"`` returning a `parity.models.ModelPair` (called
        with ``seed=`` in every worker): a user's own pair. Default: ``config.model`` built in.
      step0_checks: the step-0 gate of every cell (`parity.verdicts.step0.run_step0`) before any
        worker starts: a port that fails it is not trained (its verdicts are the result).
      echo: print the step-0 outcome to stderr.
      plots: draw the report's PNG plots (False: ``report.md`` without them; ``parity compare
        DIR`` draws them later from the same files).

    Returns:
      A `DistributedResult`.

    Raises:
      UnsupportedHere: the recipe cannot run on this arm (``plan.strategy``), with the reason.
      ValueError: among others, a pair carrying the user's training loop (``ModelPair.loop``):
        the workers would train with the harness's optimizer and loss instead.

    Examples:
      >>> config = RunConfig(model="mlp", precision="bf16-mixed", steps=6, batch_size=8)
      >>> result = run_distributed(config, DistributedPlan(devices=2, strategy="ddp"))
      >>> result.status
      'PASS'
    """
    if not isinstance(config, RunConfig):
        raise TypeError(f"run_distributed: `config` must be a RunConfig; got {type(config)}.")
    if not isinstance(plan, DistributedPlan):
        raise TypeError(f"run_distributed: `plan` must be a DistributedPlan; got {type(plan)}.")
    for n, what in ((plan.devices, "devices"), (plan.ranks, "torch ranks")):
        if config.batch_size % n:
            raise ValueError(
                f"run_distributed: batch_size {config.batch_size} must be divisible by the "
                f"{what} ({n}): every rank takes an equal slice of the global batch."
            )
    # A recipe this arm cannot run is refused with the reason; it never runs as another one.
    recipe = config.recipe
    recipe.check_arm(plan.strategy)
    refused = {
        mode: reason
        for mode in plan.jax_modes
        if (reason := recipe.unsupported(plan.strategy, mode)) is not None
    }
    if plan.inject_overflow is not None and not config.recipe.loss_scaling:
        raise ValueError(
            "run_distributed: inject_overflow needs a loss-scaled precision (fp16-mixed); "
            f"got {config.precision!r}."
        )
    bad = [f for f in frameworks if f not in ("torch", "jax")]
    if bad or not frameworks:
        raise ValueError(f"run_distributed: `frameworks` must be 'torch' and/or 'jax'; got {bad}.")
    work = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="parity-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    pair = make_pair(config, pair_factory)
    loop = getattr(pair, "loop", None)
    if loop is not None:  # the workers train with RunConfig's optimizer and loss, never the loop
        given = ", ".join(loop.describe()) or "a training loop"
        raise ValueError(
            f"run_distributed: the pair of pair_factory {pair_factory!r} carries your training "
            f"loop ({given}), which distributed workers do not run: they train with the "
            "harness's optimizer, schedule, clipping and loss (the RunConfig's), so the verdicts "
            "would not be about your loop. Check your loop on one device (parity.compare_models"
            "(..., torch_optimizer=..., jax_optimizer=...) or parity.replay_loop), or return the "
            "pair with loop=None to compare the model across devices with the harness's loop."
        )
    if pair.torch_to_flax().get("batch_stats") is not None:
        raise ValueError(
            f"run_distributed: model {config.model!r} has BatchNorm statistics; distributed "
            "runs support models without them (torch DDP keeps per-replica statistics, "
            "JAX's jit synchronises them over the global batch)."
        )
    stream = pair.make_data(config.stream_seed, config.batch_size)
    ranks: dict[str, list[dict[str, Any]]] = {}

    def train(frameworks, config, pair, stream):
        return _train_sides(
            frameworks, config, plan, pair, stream, work, pair_factory, refused, ranks
        )

    # The one cell pipeline: the step-0 gate (a broken port is not trained), then the workers.
    runs = run_cell(
        config,
        frameworks,
        pair=pair,
        stream=stream,
        step0_checks=step0_checks,
        echo=echo,
        train=train,
    )
    status, verdicts, _ = write_outputs(work, runs, plots=plots)
    result = DistributedResult(config, plan, ranks, runs, verdicts, status, speed_ratios(runs))
    write_json_atomic(work / "distributed.json", result.to_dict())
    return result


def _train_sides(frameworks, config, plan, pair, stream, work, pair_factory, refused, ranks):
    """Every side's workers (torch ranks, then each JAX mode not refused); one record per side,
    an error record where a worker failed, each carrying its distributed rows."""
    base = {
        "config": config.to_dict(),
        "strategy": plan.strategy,
        "inject": None
        if plan.inject_overflow is None
        else {
            "step": plan.inject_overflow[0],
            "rank": plan.inject_overflow[1],
            "rows": [
                plan.inject_overflow[1] * config.batch_size // plan.ranks,
                (plan.inject_overflow[1] + 1) * config.batch_size // plan.ranks,
            ],
        },
        "pair_factory": pair_factory,
    }
    groups: dict[str, list[dict[str, Any]]] = {}
    if "torch" in frameworks:
        port = free_port()
        groups["torch"] = [
            dict(
                base,
                side="torch",
                rank=r,
                world=plan.ranks,
                port=port,
                torch_backend=plan.torch_backend,
                out=str(work / f"torch-{r}.json"),
            )
            for r in range(plan.ranks)
        ]
    if "jax" in frameworks:
        for mode in (m for m in plan.jax_modes if m not in refused):
            n_proc = plan.devices if mode == "multiprocess" else 1
            port = free_port() if mode == "multiprocess" else 0
            groups[f"jax:{mode}"] = [
                dict(
                    base,
                    side="jax",
                    mode=mode,
                    rank=r,
                    world=plan.devices,
                    port=port,
                    platform=plan.jax_platform,
                    hlo_dump_dir=str(work / f"hlo-{mode}-{r}"),
                    out=str(work / f"jax-{mode}-{r}.json"),
                )
                for r in range(n_proc)
            ]
    records = []
    env = _worker_env()
    # Every worker is forked by one process that imported the workers' modules once.
    preload = _preload(frameworks, plan.strategy)
    with forking(preload, env, work / "logs" / "zygote.log") as zygote:
        for side, specs in groups.items():
            try:
                ranks[side] = _run_group(
                    side.replace(":", "-"), specs, plan.timeout_s, work, env, zygote
                )
            except WorkerError as e:  # recorded and failed by compare, as a trainer's exception
                print(f"error: {side} {config.model} {config.precision}: {e}", file=sys.stderr)
                record = build_error_record("torch" if side == "torch" else "jax", config, e)
                records.append(dict(record, **_labels(side, plan)))
                continue
            records.append(_record(side, config, plan, pair, stream, ranks[side][0]))
    rows = _rank_rows(config, plan, ranks, refused if "jax" in frameworks else {})
    for record in records:
        side = record["distributed"].rsplit(" ", 1)[0]
        record["distributed_verdicts"] = [v.to_dict() for v in _side_rows(rows, side)]
    return records


# -- verdicts ------------------------------------------------------------------------------------


def _verdict(
    config: RunConfig, kind: str, check: str, compared: str, value, tolerance, passed, detail=""
):
    return verdict(
        **cell_fields(config),
        check=check,
        compared=compared,
        value=value,
        tolerance=tolerance,
        passed=passed,
        detail=detail,
        mode="distributed",
        kind=kind,
    )


def _trajectory(result: dict) -> list[tuple]:
    return [(s["loss_scale"], s["skipped"]) for s in result["steps"]]


def _side_rows(rows: list[Verdict], side: str) -> list[Verdict]:
    """The rows a side's record stores: its own, and the arm's (a refused JAX mode)."""
    return [v for v in rows if v.compared == side or v.kind == "jax mode"]


def _rank_rows(config, plan, ranks, refused=None) -> list[Verdict]:
    """The arm's own checks, one side each (``compared`` names the side): what compare cannot
    see from rank 0's record, and one row per JAX mode the arm refused (`refused`: mode ->
    reason). Torch against JAX is compare's (every step, the usual bands)."""
    rows = []
    # 1. loss-scale trajectory and skip decisions identical across ranks.
    for side, results in ranks.items():
        if len(results) > 1:
            first = _trajectory(results[0])
            same = all(_trajectory(r) == first for r in results[1:])
            rows.append(
                _verdict(
                    config,
                    "ranks agree",
                    "loss scale and skips identical across ranks",
                    side,
                    "identical" if same else "differ",
                    "identical",
                    same,
                    f"{len(results)} ranks, {len(first)} steps",
                )
            )
    # 2. the injected overflow is skipped on every rank of every side.
    if plan.inject_overflow is not None:
        step, rank = plan.inject_overflow
        for side, results in ranks.items():
            flags = [
                next((s["skipped"] for s in r["steps"] if s["step"] == step), None) for r in results
            ]
            ok = bool(flags) and all(f is True for f in flags)
            rows.append(
                _verdict(
                    config,
                    "injected overflow",
                    f"injected overflow (rank {rank}, step {step}) skipped on every rank",
                    side,
                    f"skipped on {sum(f is True for f in flags)}/{len(flags)} ranks",
                    "all ranks",
                    ok,
                )
            )
    # 3. replicated parameters identical across ranks.
    for side, results in ranks.items():
        # One digest per parameter copy: per device where the worker saw several, else per rank.
        digests = []
        for r in results:
            copies = r.get("device_params_digests") or []
            digests.extend(
                copies if copies else [r["params_digest"]] if r.get("params_digest") else []
            )
        if len(digests) > 1:
            same = len(set(digests)) == 1
            rows.append(
                _verdict(
                    config,
                    "replicated params",
                    "replicated params identical across ranks",
                    side,
                    "identical" if same else f"{len(set(digests))} distinct copies",
                    "bit-identical",
                    same,
                    f"{len(digests)} copies (sha256 of every parameter)",
                )
            )
    # 4. the gradient-reduction dtype on each side.
    expected = config.policy.reduce_dtype.name
    for side, results in ranks.items():
        seen = results[0]["reduce_dtypes"]
        if plan.devices == 1 and side != "torch" or not seen and plan.ranks == 1:
            continue
        rows.append(
            _verdict(
                config,
                "reduction dtype",
                "gradient reduction dtype",
                side,
                ", ".join(seen) or "none seen",
                expected,
                seen == [expected],
                results[0].get("reduce_dtype_method", ""),
            )
        )
    rows += [
        _verdict(config, "jax mode", "JAX mode", f"jax:{mode}", "unsupported here", "-", None, why)
        for mode, why in (refused or {}).items()
    ]
    return rows


def format_distributed(result: DistributedResult, *, table: bool = True) -> str:
    """The verdicts (`table`) plus per-device speed and memory per side, and the status."""
    lines = [format_verdicts(result.verdicts, cell_configs(result.runs)), ""] if table else []
    lines.append("speed and memory per device:")
    for side, results in result.ranks.items():
        times = results[0]["times"][result.config.timing_warmup :] or results[0]["times"]
        median = statistics.median(times) if times else float("nan")
        mem = results[0].get("peak_memory_bytes")
        lines.append(
            f"  {side:18s} median step {median * 1e3:8.2f} ms   peak memory "
            f"{(mem or 0) / 2**20:8.1f} MiB ({results[0].get('memory_method')}) "
            f"[{results[0].get('method')}]"
        )
    lines += [f"  speed, {pair}: {text}" for pair, text in result.speed.items()]
    lines.append(f"status: {result.status}")
    return "\n".join(lines)


def cli_run(args: Any, config: RunConfig, frameworks: tuple[str, ...]) -> str:
    """``python -m parity run --devices N --strategy {ddp,fsdp}``: returns `write_outputs`'s
    status (the CLI's exit code follows it).

    Raises:
      ValueError: bad input, or a recipe this arm cannot run ("unsupported here: " and the
        reason; the CLI exits 2).
    """
    inject = None
    if args.inject_overflow:
        parts = args.inject_overflow.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"--inject-overflow takes STEP:RANK (e.g. 3:1); got {args.inject_overflow!r}."
            )
        inject = (int(parts[0]), int(parts[1]))
    # Calibration runs train on one device: a nudged single-device run is no envelope for a
    # distributed one. (--speed-blocks times one device too: a distributed run reports each
    # side's step time per device instead.)
    asked = [n for n, on in (("--noise", args.noise != "none"), ("--seeds", args.seeds > 1)) if on]
    if asked:
        raise ValueError(
            f"{' and '.join(asked)}: calibration runs train on one device; with --devices "
            f"{args.devices} leave {'them' if len(asked) > 1 else 'it'} out."
        )
    plan = DistributedPlan(
        devices=args.devices,
        strategy=args.strategy or "ddp",
        torch_ranks=args.torch_ranks,
        jax_modes=tuple(args.jax_modes),
        inject_overflow=inject,
        timeout_s=args.timeout,
        torch_backend="nccl" if config.device == "gpu" else "gloo",
        jax_platform="gpu" if config.device == "gpu" else "cpu",
    )
    try:
        result = run_distributed(
            config,
            plan,
            args.out,
            frameworks=frameworks,
            step0_checks=not args.no_step0,
            echo=True,
            plots=not args.no_plots,
        )
    except UnsupportedHere as e:
        raise ValueError(f"unsupported here: {e.reason}") from e
    print(format_distributed(result))
    out = Path(args.out).resolve()
    print(f"results: {out / 'results.json'} (per rank: {out / 'distributed.json'})")
    print(f"report: {out / 'report.md'}")
    return result.status
