"""What an ``accelerate launch`` asked for, checked against what the processes got: launches that
would silently train with one process or another layout are refused, FSDP2 is switched on for
multi-process CPU launches (gloo), and the FSDP2 layout a model really took is described from the
module's own state (the log line ``FSDP2: ...``).

On a machine without GPUs an FSDP config runs FSDP2 when launched *without* ``--cpu``::

    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml --num_processes 2 \\
        train_decoder.py configs/tiny/decoder.yaml

(Accelerate's ``--cpu`` starts a single process whatever the config's ``num_processes``:
:func:`check_launch` refuses that.)"""

from __future__ import annotations

import contextlib
import os

import torch

# the variables a process launched by torchrun, mpirun or Accelerate's MPI launcher learns its
# process count from (Accelerate's PartialState reads the same)
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("true", "1", "yes")


def world_size() -> int:
    for name in WORLD_SIZE_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 1


def check_launch() -> None:
    """Refuse, before anything is built, a launch that would train with other processes than its
    Accelerate config names:

    * ``accelerate launch --cpu`` with a multi-process config: Accelerate's simple launcher starts
      this one process (it sets ``MASTER_ADDR`` for the config's process count, but starts no
      others), so an 8-process FSDP or DDP config would train unsharded on one CPU;
    * a ``parallelism_config`` whose sizes multiply to another count than the processes launched
      (``fsdp_hybrid_16gpu.yaml`` on fewer than 16), or one with nothing left for FSDP to shard
      over (``dp_shard`` 1)."""
    n = world_size()
    if _flag("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and n == 1:
        raise ValueError(
            "accelerate launch --cpu started a single process for a multi-process config "
            "(Accelerate's --cpu never starts more): on a machine without GPUs leave out --cpu "
            "and pass --num_processes (FSDP then runs FSDP2 over gloo), or pass --num_processes 1"
        )
    if not _flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return
    sizes = {
        name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
        for name in ("dp_replicate", "dp_shard", "tp", "cp")
    }
    total = 1
    for size in sizes.values():
        total *= size
    layout = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1) or "1"
    if total != n:
        raise ValueError(
            f"the Accelerate config's parallelism_config ({layout}) needs {total} processes but "
            f"{n} were launched: pass --parallelism_config_dp_replicate_size R "
            f"--parallelism_config_dp_shard_size S with R x S = {n} (docs/full_scale.md, "
            "'FSDP on CPU')"
        )
    if _flag("ACCELERATE_USE_FSDP") and sizes["dp_shard"] < 2 and sizes["cp"] < 2:
        raise ValueError(
            f"the Accelerate config's parallelism_config ({layout}) leaves FSDP nothing to shard "
            "over: --parallelism_config_dp_shard_size must be at least 2"
        )


@contextlib.contextmanager
def parallelism_deferred(active: bool):
    """While ``Accelerator`` is built for an FSDP launch on CPU processes, hide the launch's
    ``parallelism_config``: Accelerate builds and validates its device mesh in the constructor,
    and refuses it for the multi-CPU state it starts in; :func:`use_fsdp_on_cpu` builds it once
    the state is FSDP."""
    name = "ACCELERATE_USE_PARALLELISM_CONFIG"
    saved = os.environ.pop(name, None) if active else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def forget_fsdp_on_cpu() -> None:
    """Before another Accelerator is built in the same process: take back the FSDP mark that
    :func:`use_fsdp_on_cpu` (or, on GPUs, Accelerate's own FSDP set-up) left on the process
    state, which the process had as multi-CPU or multi-GPU; the new run decides its strategy
    afresh (an FSDP mark there would skip Accelerate's FSDP plugin set-up)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    shared = PartialState._shared_state
    if shared.get("distributed_type") == DistributedType.FSDP:
        gpu = torch.cuda.is_available()
        shared["distributed_type"] = DistributedType.MULTI_GPU if gpu else DistributedType.MULTI_CPU


def use_fsdp_on_cpu(accelerator, mixed_precision: str) -> None:
    """Run FSDP2 on a multi-process CPU launch (gloo) when the launch asks for FSDP
    (``ACCELERATE_USE_FSDP=true``, as ``accelerate launch`` with an FSDP config sets it).

    Accelerate applies its FSDP plugin on accelerators only and silently trains with DDP on CPUs;
    FSDP2's ``fully_shard`` itself runs on CPU tensors over gloo, so switching the state to FSDP
    lets the sharded code path (and its checkpoints) run, and be tested, on a machine without
    GPUs. The launch's ``parallelism_config`` (hybrid sharding) gets its device mesh here (see
    :func:`parallelism_deferred`); CPU offload keeps its policy but does not pin memory (pinning
    needs a GPU driver; the shards are in CPU memory either way). FSDP1 needs CUDA devices and is
    refused here."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables the launcher set
    if plugin.fsdp_version != 2:
        raise ValueError(
            "FSDP on CPU processes needs fsdp_version: 2 in the Accelerate config (FSDP1 shards "
            "on CUDA devices only)"
        )
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and not torch.cuda.is_available():
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    # every later AcceleratorState() (the prepared optimizer's, the data loader's) copies the
    # process state's distributed type over its own, as Accelerate's own FSDP set-up records it
    # there: without this the run is back in multi-CPU mode after prepare (no FSDP no_sync,
    # multi-CPU gradient clipping and saving)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if _flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        from accelerate.parallelism_config import ParallelismConfig

        config = ParallelismConfig()  # from the PARALLELISM_CONFIG_* variables
        state.parallelism_config = config
        state.device_mesh = config.get_device_mesh(accelerator.device.type)
        config._validate_accelerator(accelerator)


def fsdp_layout(model: torch.nn.Module) -> dict:
    """How FSDP2 really holds ``model`` (after ``accelerator.prepare``), read from the module's
    own state rather than from the config that asked for it: ``sharded`` (parameters that are
    ``DTensor`` shards) of ``params``, ``mesh`` (``{dimension: size}``; ``shard`` when unnamed),
    ``units`` (``fully_shard`` groups below the root), of which ``resharding`` free their gathered
    weights after the forward and ``offloaded`` keep their shards in CPU memory; ``compute`` and
    ``reduce``: the dtypes the units gather their weights in and reduce-scatter gradients in
    (``"float32"`` where the policy leaves the parameters' own).

    The root's own setting is left out: FSDP2 overrides it on the first forward (the root's
    weights are needed again at once in backward). Accelerate gives a final norm it finds a unit
    of its own that never reshards after the forward, so ``resharding`` is one short of ``units``
    under ``reshard_after_forward: true`` when the model has one."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    shards = [p for p in params if isinstance(p, DTensor)]
    mesh = shards[0].device_mesh if shards else None
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    groups = [_param_groups(m) for m in units]
    policies = [g.mp_policy for gs in groups for g in gs]

    def dtypes(field: str) -> str:
        names = {str(getattr(p, field) or torch.float32).removeprefix("torch.") for p in policies}
        return "/".join(sorted(names))

    return {
        "sharded": len(shards),
        "params": len(params),
        "mesh": dict(zip(mesh.mesh_dim_names or ("shard",) * mesh.ndim, mesh.shape))
        if mesh is not None
        else {},
        "units": len(units),
        "resharding": sum(any(g.post_forward_mesh_info is not None for g in gs) for gs in groups),
        "offloaded": sum(
            any(fp.offload_to_cpu for g in gs for fp in g.fsdp_params) for gs in groups
        ),
        "compute": dtypes("param_dtype"),
        "reduce": dtypes("reduce_dtype"),
    }


def _param_groups(unit) -> list:
    """The ``FSDPParamGroup`` objects of an FSDP2 unit: recent torch keeps a list (a unit may hold
    several), older torch a single optional one."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def describe_fsdp(model: torch.nn.Module) -> str:
    """One line for the log: :func:`fsdp_layout` of ``model``."""
    layout = fsdp_layout(model)
    mesh = " x ".join(f"{k} {v}" for k, v in layout["mesh"].items())
    return (
        f"FSDP2: {layout['sharded']} of {layout['params']} parameters are DTensor shards on a "
        f"{len(layout['mesh'])}-D mesh ({mesh}); of {layout['units']} units "
        f"{layout['resharding']} reshard after the forward, {layout['offloaded']} offload to CPU; "
        f"compute in {layout['compute']}, gradients reduced in {layout['reduce']}"
    )
