"""``python -m parity replay``: the replay of a training loop from the command line.

Both optimizers on identical gradients and both losses on identical logits (`parity.replay`),
without training, in seconds. The loop's pieces are named as ``package.module:attr``::

    python -m parity replay --model mlp \\
        --torch-optimizer my_loop:optimizer --jax-optimizer my_port:optimizer
    python -m parity replay \\
        --torch-model examples.parity_ci.torch_model:reference \\
        --flax-model examples.parity_ci.flax_model:FlaxNet \\
        --batches examples.training_loop:batches \\
        --torch-optimizer examples.training_loop.torch_loop:optimizer \\
        --torch-scheduler examples.training_loop.torch_loop:scheduler --torch-clip 1.0 \\
        --jax-optimizer examples.training_loop.jax_loop:optimizer \\
        --torch-loss examples.training_loop.torch_loop:loss \\
        --jax-loss examples.training_loop.jax_loop:loss

The pair is a built-in model (``--model``, with the harness's data) or yours (``--torch-model``,
``--flax-model``, ``--batches``). Exit codes as ``run``'s: 0 PASS, 1 a replay row failed, 2 bad
input (one line naming the option, the value, what it takes and the closest valid name),
4 INCONCLUSIVE (nothing failed, but a row could not decide on this data).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from parity.api import replay_loop
from parity.cell import builtin_pair
from parity.core.config import ConfigError, RunConfig
from parity.core.recipes import resolve_precision
from parity.core.records import write_json_atomic
from parity.core.references import (
    call_factory,
    closest,
    load_function,
    load_optax,
    load_reference,
    required_arguments,
)
from parity.data import DataSpec
from parity.models import MODEL_NAMES
from parity.pairs.adapters import AdapterError
from parity.replay.rows import replay_status, replay_verdicts
from parity.training.user_loop import TrainingLoop

__all__ = ["add_replay_parser", "run_replay"]

TASKS = ("classification", "lm", "regression")

# TrainingLoop's and compare_models' parameter names -> this command's options
_FLAGS = {
    "torch_optimizer": "--torch-optimizer",
    "torch_scheduler": "--torch-scheduler",
    "torch_clip": "--torch-clip",
    "jax_optimizer": "--jax-optimizer",
    "torch_loss": "--torch-loss",
    "jax_loss": "--jax-loss",
    "replay_steps": "--steps",
    "precision": "--precision",
    "task": "--task",
    "batches": "--batches",
}


def _flag_names(text: str) -> str:
    """A library message with this command's option names for the parameters it names."""
    return re.sub(r"`(\w+)`", lambda m: _FLAGS.get(m.group(1), m.group(0)), text)


def _choice(option: str, allowed: tuple[str, ...]):
    """argparse type: one of `allowed`, refused naming the closest."""

    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(
                f"must be one of {', '.join(allowed)}; got {text!r}{closest(text, allowed)}"
            )
        return text

    return parse


def _replay_steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1 (real batches replayed); got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1 (real batches replayed); got {value}"
        )
    return value


def _torch_clip(text: str | None) -> Any:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return load_function(
            "--torch-clip", text, 1, "a max global norm > 0, or a callable parameters -> Any"
        )
    if not 0 < value < float("inf"):
        raise ValueError(
            f"--torch-clip must be a max global norm > 0 (or 'package.module:attr' of a callable "
            f"parameters -> Any); got {text!r}."
        )
    return value


def _torch_model(reference: str, seed: int) -> Any:

    option = "--torch-model"
    obj = load_reference(option, reference)
    if not isinstance(obj, torch.nn.Module) and callable(obj):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            obj = call_factory(option, reference, obj)
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(
            f"{option} {reference!r} gives a {type(obj).__name__}; it takes a torch.nn.Module, "
            "its class or a zero-argument factory."
        )
    return obj


def _batches(reference: str) -> Any:
    option = "--batches"
    obj = load_reference(option, reference)
    if callable(obj) and required_arguments(obj) == 0:
        obj = call_factory(option, reference, obj)
    return obj


def add_replay_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``replay`` to `parity.cli.commands`'s subcommands."""

    replay = sub.add_parser(
        "replay",
        help="replay your training loop (optimizers on identical gradients, losses on identical "
        "logits) without training; exit 0 PASS, 1 FAIL",
        description="Both optimizers on identical gradients and both losses on identical logits; "
        "name each piece as package.module:attr.",
    )
    pair = replay.add_argument_group(
        "the model pair: --model, or --torch-model/--flax-model/--batches"
    )
    pair.add_argument(
        "--model",
        type=_choice("--model", tuple(MODEL_NAMES)),
        default=None,
        help=f"a built-in pair ({', '.join(MODEL_NAMES)}) on the harness's data",
    )
    pair.add_argument(
        "--torch-model",
        metavar="MODULE:ATTR",
        help="your torch.nn.Module (or its class / a zero-argument factory, called after "
        "torch.manual_seed(--seed))",
    )
    pair.add_argument(
        "--flax-model",
        metavar="MODULE:ATTR",
        help="your Flax module (linen, NNX, Hugging Face; or a zero-argument factory)",
    )
    pair.add_argument(
        "--batches",
        metavar="MODULE:ATTR",
        help="a sequence of (inputs, targets), a BatchStream, a callable step -> (inputs, "
        "targets), or a zero-argument factory returning one",
    )
    pair.add_argument(
        "--transfer",
        metavar="MODULE:ATTR",
        help="torch module -> Flax variables (default: the automatic mapping)",
    )
    pair.add_argument(
        "--task",
        type=_choice("--task", TASKS),
        default="classification",
        help=f"with --torch-model: {', '.join(TASKS)} (default classification)",
    )
    pair.add_argument("--seed", type=int, default=0, help="torch init (and built-in data) seed")
    pair.add_argument(
        "--data", default="synthetic", help="with --model: the harness's --data (default synthetic)"
    )
    pair.add_argument(
        "--batch-size", type=_replay_steps, default=None, help="with --model: examples per batch"
    )
    loop = replay.add_argument_group("your training loop (each as MODULE:ATTR)")
    loop.add_argument(
        "--torch-optimizer", metavar="MODULE:ATTR", help="torch module -> torch.optim.Optimizer"
    )
    loop.add_argument(
        "--torch-scheduler",
        metavar="MODULE:ATTR",
        help="optimizer -> LRScheduler (stepped after every optimizer step)",
    )
    loop.add_argument(
        "--torch-clip",
        metavar="NORM|MODULE:ATTR",
        help="a max global norm (clip_grad_norm_ after unscaling) or a callable parameters -> Any",
    )
    loop.add_argument(
        "--jax-optimizer",
        metavar="MODULE:ATTR",
        help="an optax.GradientTransformation or a zero-argument factory returning one",
    )
    loop.add_argument("--torch-loss", metavar="MODULE:ATTR", help="(logits, targets) -> loss")
    loop.add_argument("--jax-loss", metavar="MODULE:ATTR", help="(logits, targets) -> loss")
    replay.add_argument(
        "--precision",
        default="fp32",
        help="the run's precision (decides loss scaling: fp16-mixed replays a skipped step)",
    )
    replay.add_argument(
        "--steps", type=_replay_steps, default=4, help="real batches replayed (default 4)"
    )
    replay.add_argument(
        "--no-jit", action="store_true", help="the JAX optimizer step and loss eagerly"
    )
    replay.add_argument("--json", default=None, help="also write the rows and record here")
    return replay


def _check_sources(args: argparse.Namespace) -> None:
    own = {"--torch-model": args.torch_model, "--flax-model": args.flax_model}
    own["--batches"] = args.batches
    given = [k for k, v in own.items() if v is not None]
    if args.model is not None and given:
        raise ValueError(
            f"--model {args.model!r} and {', '.join(given)} were both given: replay a built-in "
            "pair (--model) or yours (--torch-model, --flax-model, --batches), not both."
        )
    if args.model is None:
        missing = [k for k, v in own.items() if v is None]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} missing: give --model NAME (a built-in pair), or "
                "--torch-model, --flax-model and --batches (yours)."
            )
    elif args.transfer is not None:
        raise ValueError("--transfer is for your own pair (--torch-model); --model has its own.")
    pairs = (("--torch-optimizer", "--jax-optimizer"), ("--torch-loss", "--jax-loss"))
    values = vars(args)
    for a, b in pairs:
        has_a = values[a[2:].replace("-", "_")] is not None
        has_b = values[b[2:].replace("-", "_")] is not None
        if has_a != has_b:
            given, missing = (a, b) if has_a else (b, a)
            raise ValueError(
                f"{given} was given without {missing}: the replay compares the two sides, so "
                "name both."
            )
    for name in ("--torch-scheduler", "--torch-clip"):
        if values[name[2:].replace("-", "_")] is not None and args.torch_optimizer is None:
            raise ValueError(f"{name} needs --torch-optimizer (it belongs to your torch loop).")
    if args.torch_optimizer is None and args.torch_loss is None:
        raise ValueError(
            "nothing to replay: name --torch-optimizer and --jax-optimizer, or --torch-loss and "
            "--jax-loss (or both pairs)."
        )


def _loop(args: argparse.Namespace) -> Any:

    pieces = dict(
        torch_optimizer=load_function(
            "--torch-optimizer", args.torch_optimizer, 1, "a callable torch module -> optimizer"
        ),
        torch_scheduler=load_function(
            "--torch-scheduler", args.torch_scheduler, 1, "a callable optimizer -> LRScheduler"
        ),
        torch_clip=_torch_clip(args.torch_clip),
        jax_optimizer=load_optax("--jax-optimizer", args.jax_optimizer),
        torch_loss=load_function(
            "--torch-loss", args.torch_loss, 2, "a callable (logits, targets) -> loss"
        ),
        jax_loss=load_function(
            "--jax-loss", args.jax_loss, 2, "a callable (logits, targets) -> loss"
        ),
    )
    try:
        return TrainingLoop(**pieces, replay_steps=args.steps, replay_jit=not args.no_jit)
    except (TypeError, ValueError) as e:
        raise ValueError(_flag_names(str(e))) from None


def _builtin(args: argparse.Namespace, loop: Any, precision: str):

    values = dict(model=args.model, precision=precision, steps=args.steps, seed=args.seed)
    values["data"] = args.data
    if args.batch_size is not None:
        values["batch_size"] = args.batch_size
    try:
        config = RunConfig(**values)
    except ConfigError as e:
        raise ValueError(f"--{e.field.replace('_', '-')}: {e}") from None
    DataSpec.parse(config.data).check()
    pair = builtin_pair(config)
    stream = pair.make_data(config.stream_seed, config.batch_size)
    return replay_verdicts(pair, config, stream.batch, loop, steps=args.steps, jit=loop.replay_jit)


def _own(args: argparse.Namespace, loop: Any, precision: str):

    torch_model = _torch_model(args.torch_model, args.seed)
    flax_model = load_reference("--flax-model", args.flax_model)
    if isinstance(flax_model, type) or (
        callable(flax_model)
        and not hasattr(flax_model, "apply")
        and required_arguments(flax_model) == 0
    ):
        flax_model = call_factory("--flax-model", args.flax_model, flax_model)
    transfer = load_function(
        "--transfer", args.transfer, 1, "a callable torch module -> Flax variables"
    )
    result = replay_loop(
        torch_model,
        flax_model,
        transfer,
        _batches(args.batches),
        **{k: getattr(loop, k) for k in _FLAGS if k.startswith(("torch_", "jax_"))},
        precision=precision,
        task=args.task,
        steps=args.steps,
        jit=loop.replay_jit,
        name=args.torch_model.split(":")[-1],
    )
    return result.verdicts, result.replay


def run_replay(args: argparse.Namespace) -> int:
    """``replay``'s body: prints one line per replay row and the status; returns the exit code.

    Raises:
      ValueError: bad input (`parity.cli.commands.main` prints it as one line, exit 2).
    """

    _check_sources(args)
    try:
        precision = resolve_precision(args.precision)
    except ValueError as e:
        raise ValueError(_flag_names(str(e))) from None
    loop = _loop(args)
    try:
        rows, record = (_builtin if args.model else _own)(args, loop, precision)
    except AdapterError as e:  # the user's modules do not fit together: bad input
        raise ValueError(_flag_names(str(e))) from None
    status = replay_status(rows)
    for row in rows:
        mark = {True: "PASS", False: "FAIL", None: "----"}[row.passed]
        print(f"{mark}  {row.check}: {row.value}; {row.detail}")
    print(f"replay ({record.get('seconds', 0):.1f} s): {status}")
    if args.json:
        write_json_atomic(
            args.json,
            {"status": status, "verdicts": [v.to_dict() for v in rows], "replay": record},
        )
    return {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 4}[status]
