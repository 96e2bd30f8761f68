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

import numpy as np


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _write(path: str, data: dict[str, Any]) -> None:
    from parity.records import write_json_atomic

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
    import torch

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


def _make_pair(spec: dict, config: Any, get_model_pair):
    if spec.get("pair_factory"):
        from parity.distributed.run import load_pair_factory

        return load_pair_factory(spec["pair_factory"])(seed=config.seed)
    return get_model_pair(config.model, seed=config.seed, **config.model_overrides)


# -- torch ---------------------------------------------------------------------------------------


def torch_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from parity import measure
    from parity.config import RunConfig
    from parity.models import get_model_pair, loss_torch
    from parity.train_torch import build_torch_optimizer

    global _TorchPoison
    _TorchPoison = _torch_poison()
    torch.set_num_threads(1)  # N ranks share the machine
    torch.set_float32_matmul_precision("highest")
    config = RunConfig.from_dict(spec["config"])
    rank, world, strategy = spec["rank"], spec["world"], spec["strategy"]
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
        pair = _make_pair(spec, config, get_model_pair)
        model = pair.torch_model.to(device)
        policy = config.policy
        compute = getattr(torch, policy.compute_dtype.name)
        reduce = getattr(torch, policy.reduce_dtype.name)
        use_autocast = False
        if strategy == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)

            def recording_hook(state, bucket):
                # DDP all-reduces the gradient buckets in the parameters' dtype.
                reduce_dtypes.add(str(bucket.buffer().dtype).replace("torch.", ""))
                return default_hooks.allreduce_hook(state, bucket)

            wrapped.register_comm_hook(dist.group.WORLD, recording_hook)
            use_autocast = config.mixed
            method = f"DDP ({backend})" + (
                f" + torch.autocast({device.type}, {policy.compute_dtype.name})"
                if use_autocast
                else ""
            )
        elif strategy == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = (
                MixedPrecisionPolicy(
                    param_dtype=compute, reduce_dtype=reduce, output_dtype=torch.float32
                )
                if config.mixed
                else MixedPrecisionPolicy()
            )
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
            for name in ("reduce_scatter_tensor", "all_reduce"):
                orig = getattr(dist, name)

                def recording(*args, _orig=orig, _name=name, **kwargs):
                    tensor = args[1] if _name == "reduce_scatter_tensor" else args[0]
                    reduce_dtypes.add(str(tensor.dtype).replace("torch.", ""))
                    return _orig(*args, **kwargs)

                setattr(dist, name, recording)
            method = (
                f"FSDP2 fully_shard ({backend}), MixedPrecisionPolicy(param_dtype="
                f"{policy.compute_dtype.name}, reduce_dtype={policy.reduce_dtype.name})"
                if config.mixed
                else f"FSDP2 fully_shard ({backend})"
            )
        else:
            raise ValueError(f"strategy must be 'ddp' or 'fsdp'; got {strategy!r}.")
        if any(b.numel() for b in model.buffers()):
            raise ValueError(
                f"model {config.model!r} has buffers (batch statistics): distributed runs "
                "support models without BatchNorm (see parity.distributed)."
            )
        optimizer = build_torch_optimizer(config, model.parameters())
        scaler = None
        if config.loss_scaling and strategy == "fsdp":
            # Sharded gradients: each rank sees only its shard, so the found-inf flag must be
            # all-reduced for every rank to skip together (torch's ShardedGradScaler does).
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(
                device.type, init_scale=config.init_scale, growth_interval=config.growth_interval
            )
        elif config.loss_scaling:
            scaler = torch.amp.GradScaler(
                device.type, init_scale=config.init_scale, growth_interval=config.growth_interval
            )
        stream = pair.make_data(config.stream_seed, config.batch_size)
        rows = config.batch_size // world
        params = [p for p in model.parameters() if p.requires_grad]
        log = measure.StepLog()
        scale = float(scaler.get_scale()) if scaler is not None else None
        for step in range(config.steps):
            raw_inputs, raw_targets = stream.batch(step)
            sl = slice(rank * rows, (rank + 1) * rows)
            inputs = torch.as_tensor(np.asarray(raw_inputs)[sl]).to(device)
            targets = torch.as_tensor(np.asarray(raw_targets)[sl]).to(device)
            factor = torch.as_tensor(_inject_factor(spec, step, config.batch_size)[sl]).to(device)
            dist.barrier()
            start = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=compute, enabled=use_autocast):
                logits = pair.torch_forward(wrapped, inputs, train=True)
                logits = _TorchPoison.apply(logits, factor)
                loss = loss_torch(pair.task, logits.float(), targets)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                if config.clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if config.clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
                optimizer.step()
            global_loss = loss.detach().float().clone()
            dist.all_reduce(global_loss)
            loss_value = float(global_loss) / world
            elapsed = time.perf_counter() - start
            skipped, scale_used = False, scale
            if scaler is not None:
                scale = float(scaler.get_scale())
                skipped = scale < scale_used
            if log.record(step, loss_value, scale_used, skipped, elapsed):
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
        from parity.distributed.hlo import dump_flags

        flags += " " + dump_flags(spec["hlo_dump_dir"], module_re=".*train_step.*")
    if mode != "multiprocess":
        flags += f" --xla_force_host_platform_device_count={world}"
    os.environ["XLA_FLAGS"] = flags.strip()
    if spec.get("platform", "cpu") == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax

    if mode == "multiprocess":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{spec['port']}",
            num_processes=world,
            process_id=spec["rank"],
            initialization_timeout=120,
        )
    try:
        return _jax_train(spec, jax)
    finally:
        if mode == "multiprocess":
            jax.distributed.shutdown()


def _fsdp_spec(leaf, world: int):
    from jax.sharding import PartitionSpec as P

    shape = np.shape(leaf)
    for axis, size in enumerate(shape):
        if size % world == 0 and size >= world:
            return P(*([None] * axis + ["data"]))
    return P()


def _jax_train(spec: dict[str, Any], jax) -> dict[str, Any]:
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp
    from parity import measure
    from parity.config import RunConfig, torch_device_type
    from parity.distributed.hlo import reduction_collectives, reduction_dtypes
    from parity.models import get_model_pair, loss_jax
    from parity.train_jax import build_jax_optimizer, set_learning_rate

    config = RunConfig.from_dict(spec["config"])
    world, mode, strategy = spec["world"], spec["mode"], spec["strategy"]
    devices = jax.devices()
    if len(devices) < world:
        raise ValueError(f"JAX sees {len(devices)} devices; the run needs {world}.")
    mesh = Mesh(np.array(devices[:world]), ("data",))
    multiprocess = mode == "multiprocess"
    pair = _make_pair(spec, config, get_model_pair)
    variables = pair.torch_to_flax()
    if "batch_stats" in variables:
        raise ValueError(
            f"model {config.model!r} has batch statistics: distributed runs support models "
            "without BatchNorm (see parity.distributed)."
        )
    params = jax.tree_util.tree_map(np.asarray, variables["params"])
    policy = config.policy
    if config.loss_scaling and mode == "shard_map":
        # Inside shard_map the skip decision is taken per device: loss_scaled is told the axis
        # (the gradients are already summed over it, so every device decides the same).
        inner = build_jax_optimizer(config.replace(precision="fp32"))
        scale = jaxamp.DynamicLossScale.from_preset(
            "torch", init_scale=config.init_scale, growth_interval=config.growth_interval
        )
        tx = jaxamp.loss_scaled(inner, scale, axis_name="data")
    else:
        tx = build_jax_optimizer(config)

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

    # DDP twin: torch.autocast's per-op rules; FSDP2 twin: the policy casts every param and input.
    use_autocast = config.mixed and strategy == "ddp"
    if use_autocast:
        forward = jaxamp.autocast(
            forward, dtype=policy.compute_dtype, device=torch_device_type(config.device)
        )

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
        return loss_jax(pair.task, logits.astype(jnp.float32), targets)

    if not config.mixed:
        grad_fn = jaxamp.value_and_grad(loss_fn)
        method = "float32"
    elif use_autocast:
        grad_fn = jaxamp.value_and_grad(loss_fn, reduce_dtype=policy.reduce_dtype)
        method = f"jaxamp.autocast + value_and_grad(reduce_dtype={policy.reduce_dtype.name})"
    else:
        grad_fn = jaxamp.value_and_grad(loss_fn, policy=policy)
        method = f"jaxamp policy {policy}"
    method = f"{mode} over {world} devices ({strategy}), {method}"

    def step_body(params, opt_state, inputs, targets, factor, learning_rate, scale_divisor):
        opt_state = set_learning_rate(opt_state, learning_rate)
        scale_used = (
            jaxamp.get_loss_scale(opt_state).loss_scale
            if config.loss_scaling
            else jnp.float32(jnp.nan)
        )
        loss, grads = grad_fn(
            params,
            inputs,
            targets,
            factor,
            loss_scale=opt_state if config.loss_scaling else None,
        )
        if scale_divisor != 1:
            loss = loss / scale_divisor
            grads = jax.tree_util.tree_map(lambda g: g / scale_divisor, grads)
        return loss, grads, opt_state, scale_used

    def finish(params, opt_state, grads, loss, scale_used):
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if config.loss_scaling:
            skipped = jnp.logical_not(jaxamp.amp_info(opt_state).last_step_finite)
        else:
            skipped = jnp.bool_(False)
        metrics = {
            "loss": loss,
            "loss_scale": jnp.asarray(scale_used, jnp.float32),
            "skipped": skipped,
        }
        return params, opt_state, metrics

    if mode == "shard_map":
        # Explicit SPMD: each device's local mean loss / N; the transpose of the replicated
        # params' use sums the per-device gradients (psum) into the global mean gradient.
        def local(params, opt_state, inputs, targets, factor, learning_rate):
            loss, grads, opt_state, scale_used = step_body(
                params, opt_state, inputs, targets, factor, learning_rate, world
            )
            loss = jax.lax.psum(loss, "data")
            params, opt_state, metrics = finish(params, opt_state, grads, loss, scale_used)
            return params, opt_state, metrics

        def train_step(params, opt_state, inputs, targets, factor, learning_rate):
            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), P(), P("data"), P("data"), P("data"), P()),
                out_specs=(P(), P(), P()),
            )(params, opt_state, inputs, targets, factor, learning_rate)

    else:

        def train_step(params, opt_state, inputs, targets, factor, learning_rate):
            loss, grads, opt_state, scale_used = step_body(
                params, opt_state, inputs, targets, factor, learning_rate, 1
            )
            return finish(params, opt_state, grads, loss, scale_used)

    stream = pair.make_data(config.stream_seed, config.batch_size)

    def host_batch(step):
        raw_inputs, raw_targets = stream.batch(step)
        factor = _inject_factor(spec, step, config.batch_size)
        return tuple(
            to_global(np.asarray(x), batch_sharding) for x in (raw_inputs, raw_targets, factor)
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
        loss_scale = float(host["loss_scale"]) if config.loss_scaling else None
        if log.record(step, float(host["loss"]), loss_scale, bool(host["skipped"]), elapsed):
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
