"""Multi-device parity runs: torch DDP/FSDP2 ranks vs JAX jit / shard_map / multi-process.

`run_distributed` starts every worker (`parity.distributed.worker`) as a subprocess it owns
(`WorkerGroup`: bounded by a timeout, ended by PID on success, failure and Ctrl-C), collects the
per-rank results and judges them:

- per-step loss, torch vs each JAX mode, with `parity.verdicts.compare.compare_runs` (the usual bands);
- loss-scale trajectory and skip decisions identical across ranks, and across frameworks;
- an injected non-finite gradient on one rank (fp16) skipped on every rank, on both sides;
- replicated parameters bit-identical across ranks (torch ranks, JAX devices and processes);
- the gradient-reduction dtype on each side equal to the policy's ``reduce_dtype`` (torch: DDP
  bucket dtype / FSDP2 reduction dtype; JAX: the post-SPMD HLO's all-reduce/reduce-scatter);
- step time and memory per device, reported with their methods (not judged).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from parity.config import RunConfig
from parity.distributed.procs import WorkerGroup, free_port
from parity.models import get_model_pair
from parity.perf import measure
from parity.perf.hardware import UnsupportedHere
from parity.training.records import build_run_record, write_json_atomic
from parity.verdicts.compare import compare_runs
from parity.verdicts.rows import Verdict, format_verdicts, overall_status
from parity.verdicts.step0 import run_step0

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

    Example:
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
      runs: run records (`parity.training.records` schema), one per side/mode.
      verdicts: `parity.verdicts.rows.Verdict` rows.
      status: ``"PASS"``, ``"FAIL"`` or ``"NOTHING COMPARED"``.
    """

    config: RunConfig
    plan: DistributedPlan
    ranks: dict[str, list[dict[str, Any]]]
    runs: list[dict[str, Any]]
    verdicts: list[Any]
    status: str

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "plan": dataclasses.asdict(self.plan),
            "status": self.status,
            "verdicts": [v.to_dict() for v in self.verdicts],
            "ranks": self.ranks,
            "runs": self.runs,
        }


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # each worker sets its own device count
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_group(
    name: str, specs: list[dict[str, Any]], timeout_s: float, work: Path
) -> list[dict[str, Any]]:
    env = _worker_env()
    with WorkerGroup(timeout_s, log_dir=work / "logs") as group:
        for spec in specs:
            path = work / f"{name}-{spec['rank']}.spec.json"
            path.write_text(json.dumps(spec))
            group.start(
                f"{name.replace(':', '-')}-rank{spec['rank']}",
                [sys.executable, "-m", "parity.distributed.worker", str(path)],
                env=env,
            )
        group.wait()
    return [json.loads(Path(spec["out"]).read_text()) for spec in specs]


def _record(side: str, config: RunConfig, pair: Any, stream: Any, rank0: dict, label: str):
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
            "distributed": label,
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
) -> DistributedResult:
    """Runs the torch side and every JAX mode of `plan` on `config`; returns verdicts.

    Args:
      config: the run (model, precision, steps, global batch size...). The global batch size
        must divide by the number of ranks and devices.
      plan: the layout (`DistributedPlan`).
      out: folder for ``distributed.json`` (written atomically) and the worker logs; default a
        temporary folder.
      frameworks: ``("torch", "jax")`` or one of them.
      pair_factory: ``"package.module:function"`` returning a `parity.models.ModelPair` (called
        with ``seed=`` in every worker): a user's own pair. Default: ``config.model`` built in.
      step0_checks: the step-0 gate of every cell (`parity.verdicts.step0.run_step0`) before any worker
        starts: a port that fails it is not trained (its verdicts are the result).

    Returns:
      A `DistributedResult`.

    Example:
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
    pair = _pair(config, pair_factory)
    if pair.torch_to_flax().get("batch_stats") is not None:
        raise ValueError(
            f"run_distributed: model {config.model!r} has BatchNorm statistics; distributed "
            "runs support models without them (torch DDP keeps per-replica statistics, "
            "JAX's jit synchronises them over the global batch)."
        )
    stream = pair.make_data(config.stream_seed, config.batch_size)
    # The gate of every cell (parity.cell.run_cell runs the same): a broken port is not trained.
    step0 = run_step0(config, pair, stream, frameworks=frameworks) if step0_checks else None
    if step0 is not None and not step0.passed:
        result = DistributedResult(config, plan, {}, [], step0.verdicts, "FAIL")
        write_json_atomic(work / "distributed.json", result.to_dict())
        return result
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
    ranks: dict[str, list[dict[str, Any]]] = {}
    if "torch" in frameworks:
        port = free_port()
        specs = [
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
        ranks["torch"] = _run_group("torch", specs, plan.timeout_s, work)
    if "jax" in frameworks:
        for mode in (m for m in plan.jax_modes if m not in refused):
            n_proc = plan.devices if mode == "multiprocess" else 1
            port = free_port() if mode == "multiprocess" else 0
            specs = [
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
            ranks[f"jax:{mode}"] = _run_group(f"jax-{mode}", specs, plan.timeout_s, work)
    runs = {
        side: _record(side, config, pair, stream, results[0], f"{side} {plan.strategy}")
        for side, results in ranks.items()
    }
    verdicts = _verdicts(config, plan, ranks, runs)
    if "jax" in frameworks:
        verdicts += [
            _verdict(config, "JAX mode", f"jax:{mode}", "unsupported here", "-", None, reason)
            for mode, reason in refused.items()
        ]
    status = overall_status(verdicts)
    result = DistributedResult(config, plan, ranks, list(runs.values()), verdicts, status)
    write_json_atomic(work / "distributed.json", result.to_dict())
    return result


def _pair(config: RunConfig, pair_factory: str | None):
    if pair_factory is None:
        return get_model_pair(config.model, seed=config.seed, **config.model_overrides)
    return load_pair_factory(pair_factory)(seed=config.seed)


def load_pair_factory(spec: str):
    """Imports ``"package.module:function"`` (a user's `ModelPair` factory)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"pair_factory must be 'package.module:function'; got {spec!r}.")
    module_name, attr = spec.split(":")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ValueError(
            f"pair_factory: {module_name} has no {attr!r}.{_closest(attr, tuple(names))}"
        )
    return getattr(module, attr)


# -- verdicts ------------------------------------------------------------------------------------


def _verdict(config: RunConfig, check: str, compared: str, value, tolerance, passed, detail=""):
    return Verdict(
        config.model,
        config.precision,
        config.device,
        check=check,
        compared=compared,
        value=value,
        tolerance=tolerance,
        passed=passed,
        detail=detail,
        mode="distributed",
    )


def _trajectory(result: dict) -> list[tuple]:
    return [(s["loss_scale"], s["skipped"]) for s in result["steps"]]


def _verdicts(config, plan, ranks, runs) -> list[Any]:
    rows = []
    policy = config.policy
    # 1. per-step loss: torch vs each JAX mode, the usual bands.
    torch_run = runs.get("torch")
    for side, run in runs.items():
        if side == "torch" or torch_run is None:
            continue
        for v in compare_runs([torch_run, run]):
            rows.append(dataclasses.replace(v, compared=f"{side} vs torch {plan.strategy}"))
    # 2. loss-scale trajectory and skip decisions identical across ranks and frameworks.
    for side, results in ranks.items():
        if len(results) > 1:
            first = _trajectory(results[0])
            same = all(_trajectory(r) == first for r in results[1:])
            rows.append(
                _verdict(
                    config,
                    "loss scale and skips identical across ranks",
                    side,
                    "identical" if same else "differ",
                    "identical",
                    same,
                    f"{len(results)} ranks, {len(first)} steps",
                )
            )
    if "torch" in ranks:
        ref = _trajectory(ranks["torch"][0])
        for side, results in ranks.items():
            if side == "torch":
                continue
            mine = _trajectory(results[0])
            same = mine == ref
            first_diff = next(
                (i for i, (a, b) in enumerate(zip(ref, mine, strict=False)) if a != b), None
            )
            rows.append(
                _verdict(
                    config,
                    "loss scale and skips identical to torch",
                    f"{side} vs torch",
                    "identical" if same else f"differ from step {first_diff}",
                    "identical",
                    same,
                    f"skipped steps torch {[i for i, s in enumerate(ref) if s[1]]}, "
                    f"{side} {[i for i, s in enumerate(mine) if s[1]]}",
                )
            )
    # 3. the injected overflow is skipped on every rank of every side.
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
                    f"injected overflow (rank {rank}, step {step}) skipped on every rank",
                    side,
                    f"skipped on {sum(f is True for f in flags)}/{len(flags)} ranks",
                    "all ranks",
                    ok,
                )
            )
    # 4. replicated parameters identical across ranks.
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
                    "replicated params identical across ranks",
                    side,
                    "identical" if same else f"{len(set(digests))} distinct copies",
                    "bit-identical",
                    same,
                    f"{len(digests)} copies (sha256 of every parameter)",
                )
            )
    # 5. the gradient-reduction dtype on each side.
    expected = policy.reduce_dtype.name
    for side, results in ranks.items():
        seen = results[0]["reduce_dtypes"]
        if plan.devices == 1 and side != "torch" or not seen and plan.ranks == 1:
            continue
        rows.append(
            _verdict(
                config,
                "gradient reduction dtype",
                side,
                ", ".join(seen) or "none seen",
                expected,
                seen == [expected],
                results[0].get("reduce_dtype_method", ""),
            )
        )
    return rows


def format_distributed(result: DistributedResult) -> str:
    """A text table of the verdicts plus per-device speed and memory per side."""
    lines = [format_verdicts(result.verdicts), "", "speed and memory per device:"]
    for side, results in result.ranks.items():
        times = results[0]["times"][result.config.timing_warmup :] or results[0]["times"]
        median = statistics.median(times) if times else float("nan")
        mem = results[0].get("peak_memory_bytes")
        lines.append(
            f"  {side:18s} median step {median * 1e3:8.2f} ms   peak memory "
            f"{(mem or 0) / 2**20:8.1f} MiB ({results[0].get('memory_method')}) "
            f"[{results[0].get('method')}]"
        )
    lines.append(f"status: {result.status}")
    return "\n".join(lines)


def cli_run(args: Any, config: RunConfig, frameworks: tuple[str, ...]) -> int:
    """``python -m parity run --devices N --strategy {ddp,fsdp}``: exit 0 pass, 1 fail, 2 a
    recipe this arm cannot run (the reason on stderr)."""
    inject = None
    if args.inject_overflow:
        parts = args.inject_overflow.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"--inject-overflow takes STEP:RANK (e.g. 3:1); got {args.inject_overflow!r}."
            )
        inject = (int(parts[0]), int(parts[1]))
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
            config, plan, args.out, frameworks=frameworks, step0_checks=not args.no_step0
        )
    except UnsupportedHere as e:
        print(f"error: unsupported here: {e.reason}", file=sys.stderr)
        return 2
    print(format_distributed(result))
    print(f"results: {(Path(args.out) / 'distributed.json').resolve()}")
    return {"PASS": 0, "FAIL": 1}.get(result.status, 3)
