"""One worker process of a distributed parity run: ``python -m parity.distributed.worker SPEC``.

SPEC is a JSON file written by `parity.distributed.run` (see `WorkerSpec` there). The worker is
either one torch rank (DDP or FSDP2 over gloo on 127.0.0.1), one JAX process of a multi-process
run (``jax.distributed.initialize``, CPU collectives), or the single JAX process driving a mesh
of N host devices (``jit`` or ``shard_map``). It writes its result JSON atomically to
``spec["out"]`` and exits 0; any exception exits 1 with the traceback in its log.

Both sides see the same global batch order (`parity.data` streams, identical on every rank);
torch rank r takes rows ``[r*B/N, (r+1)*B/N)`` of each global batch, which is exactly the shard
of device r in JAX's ``PartitionSpec("data")`` batch sharding. Dropout is off in every built-in
pair. BatchNorm: the built-in distributed runs refuse pairs with batch statistics (torch DDP keeps
per-replica statistics, JAX's jit over the global batch synchronises them: not the same model).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import resource
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torch.distributed import distributed_c10d
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from parity.core.config import RunConfig
from parity.core.losses import loss_jax, loss_torch
from parity.core.records import write_json_atomic
from parity.distributed.hlo import dump_flags, reduction_collectives, reduction_dtypes
from parity.distributed.pairs import make_pair
from parity.perf import measure
from parity.training.steps import (
    build_jax_optimizer,
    build_torch_optimizer,
    observed_step,
    step_signals,
    torch_train_step,
)


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _write(path: str, data: dict[str, Any]) -> None:
    write_json_atomic(path, data)


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


_TorchPoison: Any = None


def _inject_factor(spec: dict, step: int, global_batch: int) -> np.ndarray:
    """Per-example gradient factor: 1, or inf on the injected rank's rows at the injected step.

    Applied to the logits' gradient only (the loss stays finite, as with a real overflow in
    the backward pass), so one rank's gradient contribution is non-finite.

    The rows are torch rank ``inject["rank"]``'s slice of the global batch (``inject["rows"]``),
    the same examples on both sides whatever the JAX device count.
    """
    factor = np.ones((global_batch,), np.float32)
    inject = spec.get("inject")
    if inject and inject["step"] == step:
        start, stop = inject["rows"]
        factor[start:stop] = np.inf
    return factor


def _torch_poison():
    class Poison(torch.autograd.Function):
        """Identity forward; the backward multiplies each example's gradient by its factor."""

        @staticmethod
        def forward(ctx, logits, factor):
            ctx.save_for_backward(factor)
            return logits.view_as(logits)

        @staticmethod
        def backward(ctx, grad):
            (factor,) = ctx.saved_tensors
            shape = (-1,) + (1,) * (grad.dim() - 1)
            return grad * factor.to(grad.dtype).reshape(shape), None

    return Poison


# -- torch ---------------------------------------------------------------------------------------


def torch_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One torch rank: the recipe's model and step (`parity.training.steps.torch_train_step`)
    inside DDP or FSDP2."""
    global _TorchPoison
    _TorchPoison = _torch_poison()
    torch.set_num_threads(1)  # N ranks share the machine
    torch.set_float32_matmul_precision("highest")
    config = RunConfig.from_dict(spec["config"])
    recipe = config.recipe
    rank, world, strategy = spec["rank"], spec["world"], spec["strategy"]
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp'; got {strategy!r}.")
    recipe.check_arm(strategy)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(spec["port"])
    backend = spec.get("torch_backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank (NCCL needs the device before init)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    reduce_dtypes: set[str] = set()
    try:
        pair = make_pair(config, spec.get("pair_factory"))
        model, _ = recipe.torch_convert(pair.torch_model.to(device), device)
        input_dtype = recipe.torch_input_dtype()
        if any(b.numel() for b in model.buffers()):
            raise ValueError(
                f"model {config.model!r} has buffers (batch statistics): distributed runs "
                "support models without BatchNorm (see parity.distributed)."
            )
        if strategy == "ddp":
            wrapped = DistributedDataParallel(model)

            def recording_hook(state, bucket):
                # DDP all-reduces the gradient buckets in the parameters' dtype.
                reduce_dtypes.add(str(bucket.buffer().dtype).replace("torch.", ""))
                return default_hooks.allreduce_hook(state, bucket)

            wrapped.register_comm_hook(dist.group.WORLD, recording_hook)
            method = f"DDP ({backend}) + {recipe.torch_method('ddp')}"
        else:
            from torch.distributed.fsdp import fully_shard  # heavy (DTensor, sympy): fsdp only

            mp = recipe.torch_fsdp_policy()
            # One FSDP group per module owning parameters; tied parameters (e.g. a language
            # model's shared embedding/output matrix) stay with the root group.
            owners = collections.Counter(
                id(p) for m in model.modules() for p in m.parameters(recurse=False)
            )
            for sub in model.modules():
                direct = list(sub.parameters(recurse=False))
                if sub is not model and direct and all(owners[id(p)] == 1 for p in direct):
                    fully_shard(sub, mp_policy=mp)
            wrapped = fully_shard(model, mp_policy=mp)
            # FSDP2 reduces gradients through dist.reduce_scatter_single (the pinned torch 2.13,
            # keyword arguments) or reduce_scatter_tensor (older releases), and all_reduce for a
            # replicate dimension; the worker's own loss all-reduce goes around this recorder.
            for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
                orig = getattr(dist, name, None)
                if orig is None:
                    continue

                def recording(*args, _orig=orig, _name=name, **kwargs):
                    if _name == "all_reduce":
                        tensor = kwargs.get("tensor", args[0] if args else None)
                    else:
                        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
                    if isinstance(tensor, torch.Tensor):
                        reduce_dtypes.add(str(tensor.dtype).replace("torch.", ""))
                    return _orig(*args, **kwargs)

                setattr(dist, name, recording)
            method = f"FSDP2 fully_shard ({backend}), {recipe.torch_method('fsdp')}"
        optimizer = build_torch_optimizer(config, model.parameters())
        scaler = recipe.torch_grad_scaler(config, device.type, sharded=strategy == "fsdp")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]

        def forward_loss(inputs, targets, factor):
            with recipe.torch_autocast(device.type, strategy):
                logits = pair.torch_forward(wrapped, inputs, train=True)
                logits = _TorchPoison.apply(logits, factor)
                return loss_torch(pair.task, logits.float(), targets)

        # names=: the single-device trainer's per-step signals (gradient norm before clipping,
        # update norm, largest |scaled gradient|), measured on the reduced gradients.
        train_step = torch_train_step(
            config, forward_loss, optimizer, scaler, params, names=[n for n, _ in named]
        )
        stream = pair.make_data(config.stream_seed, config.batch_size)
        rows = config.batch_size // world
        log = measure.StepLog()
        scale = float(scaler.get_scale()) if scaler is not None else None
        for step in range(config.steps):
            raw_inputs, raw_targets = stream.batch(step)
            sl = slice(rank * rows, (rank + 1) * rows)
            inputs = torch.as_tensor(np.asarray(raw_inputs)[sl]).to(device)
            if input_dtype is not None and inputs.is_floating_point():
                inputs = inputs.to(input_dtype)
            targets = torch.as_tensor(np.asarray(raw_targets)[sl]).to(device)
            factor = torch.as_tensor(_inject_factor(spec, step, config.batch_size)[sl]).to(device)
            dist.barrier()
            start = time.perf_counter()
            loss = train_step(step, inputs, targets, factor)
            global_loss = loss.detach().float().clone()
            # The logged loss's own all-reduce (float32) goes around the FSDP arm's recorder of
            # gradient reductions (`dist.all_reduce` is patched there): it reduces no gradient.
            distributed_c10d.all_reduce(global_loss)
            loss_value = float(global_loss) / world
            elapsed = time.perf_counter() - start
            skipped, scale_used = False, scale
            if scaler is not None:
                scale = float(scaler.get_scale())
                skipped = scale < scale_used
            stop = log.record(step, loss_value, scale_used, skipped, elapsed)
            log.steps[-1].update(train_step.signals)
            if stop:
                break
        state = {}
        for name, value in model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            state[name] = full.detach().float().cpu().numpy()
        return {
            "side": "torch",
            "rank": rank,
            "world": world,
            "strategy": strategy,
            "method": method,
            "steps": log.steps,
            "times": log.times,
            "stopped_reason": log.stopped_reason,
            "params_digest": _digest([state[k] for k in sorted(state)]),
            "reduce_dtypes": sorted(reduce_dtypes),
            "reduce_dtype_method": "DDP comm hook: bucket dtype"
            if strategy == "ddp"
            else "dtype of the tensors FSDP2 passes to torch.distributed reductions",
            "peak_memory_bytes": _peak_rss_bytes(),
            "memory_method": "process peak RSS (ru_maxrss) of this rank",
            "final_params": {k: v.tolist() for k, v in state.items()}
            if spec.get("return_params")
            else None,
        }
    finally:
        dist.destroy_process_group()


# -- JAX -----------------------------------------------------------------------------------------


def jax_worker(spec: dict[str, Any]) -> dict[str, Any]:
    mode = spec["mode"]
    world = spec["world"]
    flags = os.environ.get("XLA_FLAGS", "")
    if spec.get("hlo_dump_dir"):
        flags += " " + dump_flags(spec["hlo_dump_dir"], module_re=".*train_step.*")
    if mode != "multiprocess":
        flags += f" --xla_force_host_platform_device_count={world}"
    # Read when JAX starts its backends (on first use, after this), not at import.
    os.environ["XLA_FLAGS"] = flags.strip()
    if spec.get("platform", "cpu") == "cpu":
        jax.config.update("jax_platforms", "cpu")

    if mode == "multiprocess":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{spec['port']}",
            num_processes=world,
            process_id=spec["rank"],
            initialization_timeout=120,
        )
    try:
        return _jax_train(spec)
    finally:
        if mode == "multiprocess":
            jax.distributed.shutdown()


def _fsdp_spec(leaf, world: int):
    shape = np.shape(leaf)
    for axis, size in enumerate(shape):
        if size % world == 0 and size >= world:
            return P(*([None] * axis + ["data"]))
    return P()


def _jax_train(spec: dict[str, Any]) -> dict[str, Any]:
    """The JAX side on a mesh: the recipe's forward, gradient function and optimizer, the
    README's step with its signals (`parity.training.steps.observed_step`, as the single-device
    trainer) under ``jit`` or ``shard_map``."""
    config = RunConfig.from_dict(spec["config"])
    recipe = config.recipe
    world, mode, strategy = spec["world"], spec["mode"], spec["strategy"]
    recipe.check_arm(strategy, mode)
    devices = jax.devices()
    if len(devices) < world:
        raise ValueError(f"JAX sees {len(devices)} devices; the run needs {world}.")
    mesh = Mesh(np.array(devices[:world]), ("data",))
    multiprocess = mode == "multiprocess"
    pair = make_pair(config, spec.get("pair_factory"))
    variables = pair.torch_to_flax()
    if "batch_stats" in variables:
        raise ValueError(
            f"model {config.model!r} has batch statistics: distributed runs support models "
            "without BatchNorm (see parity.distributed)."
        )
    params = jax.tree_util.tree_map(np.asarray, recipe.jax_cast(variables["params"]))
    # Inside shard_map the skip decision is taken per device: loss_scaled is told the axis (the
    # gradients are already summed over it, so every device decides the same).
    tx = build_jax_optimizer(config, axis_name="data" if mode == "shard_map" else None, pair=pair)

    if strategy == "fsdp" and mode != "shard_map":
        param_specs = jax.tree_util.tree_map(lambda x: _fsdp_spec(x, world), params)
    else:
        param_specs = jax.tree_util.tree_map(lambda x: P(), params)
    param_sharding = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs)
    batch_sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    def to_global(host, sharding):
        if multiprocess:
            # Every process holds the full host value; each contributes its addressable shards.
            return jax.make_array_from_callback(np.shape(host), sharding, lambda idx: host[idx])
        return jax.device_put(host, sharding)

    params = jax.tree_util.tree_map(to_global, params, param_sharding)
    opt_state = jax.jit(tx.init)(params)

    def forward(params, inputs):
        logits, _ = pair.flax_apply({"params": params}, inputs, train=True)
        return logits

    # DDP twin: torch.autocast's per-op rules; FSDP2 twin: the policy casts params and inputs.
    forward = recipe.jax_forward(forward, config.device, strategy)

    @jax.custom_vjp
    def poison(logits, factor):
        return logits

    def poison_fwd(logits, factor):
        return logits, factor

    def poison_bwd(factor, g):
        shape = (-1,) + (1,) * (g.ndim - 1)
        return g * factor.astype(g.dtype).reshape(shape), jnp.zeros_like(factor)

    poison.defvjp(poison_fwd, poison_bwd)

    def loss_fn(params, inputs, targets, factor):
        logits = poison(forward(params, inputs), factor)
        return loss_jax(pair.task, logits.astype(jnp.float32), targets), None

    grad_fn = recipe.jax_value_and_grad(loss_fn, strategy)
    method = (
        f"{mode} over {world} devices ({strategy}), {recipe.jax_method(config.device, strategy)}"
    )

    if mode == "shard_map":
        # Explicit SPMD: each device's local mean loss / N; the transpose of the replicated
        # params' use sums the per-device gradients (psum) into the global mean gradient.
        def local_grad_fn(params, *batch, loss_scale):
            (loss, aux), grads = grad_fn(params, *batch, loss_scale=loss_scale)
            grads = jax.tree_util.tree_map(lambda g: g / world, grads)
            return (jax.lax.psum(loss / world, "data"), aux), grads

        step = observed_step(local_grad_fn, tx, max_scaled_grad=recipe.loss_scaling)

        def train_step(params, opt_state, inputs, targets, factor, learning_rate):
            def local(params, opt_state, inputs, targets, factor, learning_rate):
                params, opt_state, (loss, _), metrics = step(
                    params, opt_state, learning_rate, inputs, targets, factor
                )
                return params, opt_state, {"loss": loss, **metrics}

            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), P(), P("data"), P("data"), P("data"), P()),
                out_specs=(P(), P(), P()),
            )(params, opt_state, inputs, targets, factor, learning_rate)

    else:
        step = observed_step(grad_fn, tx, max_scaled_grad=recipe.loss_scaling)

        def train_step(params, opt_state, inputs, targets, factor, learning_rate):
            params, opt_state, (loss, _), metrics = step(
                params, opt_state, learning_rate, inputs, targets, factor
            )
            return params, opt_state, {"loss": loss, **metrics}

    stream = pair.make_data(config.stream_seed, config.batch_size)

    def host_batch(step):
        raw_inputs, raw_targets = stream.batch(step)
        inputs = np.asarray(recipe.jax_cast(np.asarray(raw_inputs)))
        factor = _inject_factor(spec, step, config.batch_size)
        return tuple(
            to_global(np.asarray(x), batch_sharding) for x in (inputs, raw_targets, factor)
        )

    inputs, targets, factor = host_batch(0)
    lr0 = to_global(np.float32(config.lr_at(0)), replicated)
    with jax.default_matmul_precision("highest"):
        start = time.perf_counter()
        compiled = (
            jax.jit(train_step, donate_argnums=(0, 1))
            .lower(params, opt_state, inputs, targets, factor, lr0)
            .compile()
        )
        compile_time = time.perf_counter() - start
    log = measure.StepLog()
    for step in range(config.steps):
        inputs, targets, factor = host_batch(step)
        learning_rate = to_global(np.float32(config.lr_at(step)), replicated)
        jax.block_until_ready((inputs, targets, factor, learning_rate))
        start = time.perf_counter()
        params, opt_state, metrics = compiled(
            params, opt_state, inputs, targets, factor, learning_rate
        )
        jax.block_until_ready((params, opt_state, metrics))
        elapsed = time.perf_counter() - start
        host = jax.tree_util.tree_map(lambda x: np.asarray(x.addressable_data(0)), metrics)
        loss_scale = recipe.logged_scale(host["loss_scale"])
        stop = log.record(step, float(host["loss"]), loss_scale, bool(host["skipped"]), elapsed)
        log.steps[-1].update(step_signals(host, scaled=loss_scale is not None))
        if stop:
            break

    # Replicated params: every addressable copy must be bit-identical.
    digests = []
    leaves = jax.tree_util.tree_leaves(params)
    sharded = strategy == "fsdp" and mode != "shard_map"
    if not sharded:
        n_local = len(leaves[0].addressable_shards)
        for i in range(n_local):
            digests.append(_digest([np.asarray(x.addressable_shards[i].data) for x in leaves]))
    memory = measure.jax_cpu_memory(compiled)
    collectives = (
        reduction_collectives(spec["hlo_dump_dir"], "train_step")
        if spec.get("hlo_dump_dir")
        else []
    )
    return {
        "side": "jax",
        "rank": spec["rank"],
        "world": world,
        "strategy": strategy,
        "mode": mode,
        "method": method,
        "steps": log.steps,
        "times": log.times,
        "stopped_reason": log.stopped_reason,
        "compile_time_s": compile_time,
        "params_digest": digests[0] if digests else None,
        "device_params_digests": digests,
        "params_sharded": bool(sharded),
        "reduce_dtypes": reduction_dtypes(collectives, gradients_only=True),
        "reduce_collectives": collectives[:50],
        "reduce_dtype_method": "post-SPMD-partitioning HLO (XLA dump): backward all-reduce/"
        "reduce-scatter",
        "peak_memory_bytes": (memory or {}).get("peak_bytes"),
        "memory_method": "XLA memory analysis of the compiled step, per device",
        "process_peak_rss_bytes": _peak_rss_bytes(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = _load(argv[0])
    try:
        result = torch_worker(spec) if spec["side"] == "torch" else jax_worker(spec)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    result["pid"] = os.getpid()
    _write(spec["out"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
