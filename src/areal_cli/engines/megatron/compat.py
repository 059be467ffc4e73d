"""CPU compatibility shim for megatron-core 0.16.1: every workaround for its CUDA hard-codes, in one place.

megatron-core assumes a CUDA device in a few places that a CPU/gloo run reaches. Each :class:`Patch` below
names the file:line of 0.16.1 it works around, can be applied and reverted, and has a test
(``tests/unit/test_megatron_compat.py``) that runs the real mcore code path *unpatched* and expects the
CUDA failure, so an upgrade that makes a patch a no-op (or wrong) fails loudly instead of silently
carrying dead monkey-patches. The patches touch private module globals of one pinned version: any other
version is refused by :func:`check_version`.

Applied only when CUDA is absent (:func:`apply_cpu_compat` is a no-op on a CUDA machine, where mcore's own
code paths are the tested ones). Import this module only inside trainer processes, never in the CLI.

Not patches but configuration (set in :mod:`.model`, documented there): ``batch_p2p_comm=False`` (batched
p2p under gloo with virtual stages swaps activations silently), ``moe_token_dispatcher_type="alltoall"``
(``variable_seq_lengths`` is otherwise rejected even for dense models), ``perform_initialization=True``
(otherwise TP attributes are never set), dropout 0 (the RNG tracker below forks nothing).
The training path (mcore's DDP, its optimizers and sequence parallelism) adds patches of the same two
forms: a module-scoped ``torch`` for allocations on CUDA, and a call-scoped ``Tensor.type`` that names a
CPU tensor's type as its CUDA twin where mcore checks ``param.type() == 'torch.cuda.FloatTensor'``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_cli.errors import ConfigError

SUPPORTED_VERSION = "0.16.1"

_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
                        "empty_like", "full_like", "randn", "rand"})


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def check_version() -> str:
    """Raise a :class:`ConfigError` unless exactly the supported megatron-core is installed."""
    v = installed_version()
    if v is None:
        raise ConfigError("engine.name", "engine=megatron needs megatron-core, which is not installed",
                          f"pip install --no-deps megatron-core=={SUPPORTED_VERSION}")
    if v != SUPPORTED_VERSION:
        raise ConfigError("engine.name", f"megatron-core {v} is installed; engine=megatron supports only "
                          f"{SUPPORTED_VERSION} (its CPU shim patches that version's private code)",
                          f"pip install --no-deps megatron-core=={SUPPORTED_VERSION}")
    return v


def _to_cpu(device: Any) -> Any:
    import torch

    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda:"):
        return "cpu"
    return device


class _CPUCuda:
    """Stand-in for ``torch.cuda`` inside one mcore module: the current device is the CPU, synchronising
    and cache emptying are no-ops; anything else falls through to the real ``torch.cuda``."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*_a: Any, **_k: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    class Stream:
        """A CUDA stream on a CPU-only torch: work runs in order on the host, so waiting and recording
        are no-ops and an event is always complete."""

        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def wait_stream(self, *_a: Any) -> None:
            return None

        def record_event(self, *_a: Any) -> Any:
            return _CPUCuda.Event()

        def synchronize(self) -> None:
            return None

    class Event:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def record(self, *_a: Any) -> None:
            return None

        def synchronize(self) -> None:
            return None

        def wait(self, *_a: Any) -> None:
            return None

        def query(self) -> bool:
            return True

    _STREAM = None

    @classmethod
    def current_stream(cls, *_a: Any) -> Any:
        if cls._STREAM is None:
            cls._STREAM = cls.Stream()
        return cls._STREAM

    default_stream = current_stream

    @staticmethod
    def stream(_s: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cuda, name)


class _CPUTorch:
    """Stand-in for the ``torch`` global of one mcore module: tensor factories given ``device="cuda"``
    allocate on the CPU and ``torch.cuda`` is :class:`_CPUCuda`. Everything else is the real torch."""

    cuda = _CPUCuda()

    def __getattr__(self, name: str) -> Any:
        import torch

        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*a: Any, **k: Any) -> Any:
            if "device" in k:
                k["device"] = _to_cpu(k["device"])
            return attr(*a, **k)

        return factory


@dataclass
class Patch:
    name: str
    works_around: str  # the mcore 0.16.1 file:line and what it does on a CPU-only torch
    apply: Callable[[], None]
    revert: Callable[[], None]
    applied: bool = field(default=False)


def _module_torch_patch(name: str, module: str, works_around: str) -> Patch:
    """Replace ``module.torch`` by :class:`_CPUTorch` (scoped to that module, not the process)."""
    state: dict[str, Any] = {}

    def apply() -> None:
        mod = importlib.import_module(module)
        state.setdefault("orig", mod.torch)
        mod.torch = _CPUTorch()

    def revert() -> None:
        if "orig" in state:
            importlib.import_module(module).torch = state["orig"]

    return Patch(name, works_around, apply, revert)


def _tied_embedding_patch() -> Patch:
    """``setup_embeddings_and_output_layer`` moves the shared weight with ``.cuda()`` before the
    first/last-stage all-reduce; run it with ``Tensor.cuda`` as the identity, for that call only."""
    state: dict[str, Any] = {}

    def apply() -> None:
        import torch
        from megatron.core.models.common.language_module.language_module import LanguageModule

        orig = state.setdefault("orig", LanguageModule.setup_embeddings_and_output_layer)

        def setup_embeddings_and_output_layer(self: Any) -> None:
            real_cuda = torch.Tensor.cuda
            torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
            try:
                orig(self)
            finally:
                torch.Tensor.cuda = real_cuda  # type: ignore[method-assign]

        LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer

    def revert() -> None:
        if "orig" in state:
            from megatron.core.models.common.language_module.language_module import LanguageModule

            LanguageModule.setup_embeddings_and_output_layer = state["orig"]

    return Patch("tied_embeddings_cuda",
                 "models/common/language_module/language_module.py:244 weight.data.cuda() for tied "
                 "embeddings under PP (Torch not compiled with CUDA)", apply, revert)


def _cuda_type_names_patch(name: str, owner: str, attr: str, works_around: str) -> Patch:
    """Run ``owner.attr`` with ``Tensor.type()`` answering ``torch.cuda.FloatTensor`` (etc.) for CPU tensors,
    for that call only: mcore 0.16.1 validates parameter dtypes by CUDA type name."""
    state: dict[str, Any] = {}

    def apply() -> None:
        import torch

        mod = importlib.import_module(owner.split(":")[0])
        target = getattr(mod, owner.split(":")[1]) if ":" in owner else mod
        raw = state.setdefault("orig", target.__dict__[attr] if isinstance(target, type) else getattr(target, attr))
        state["target"] = target
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        orig = raw.__func__ if kind is not None else raw

        def cuda_typed(*a: Any, **k: Any) -> Any:
            real = torch.Tensor.type

            def type_(t: Any, *ta: Any, **tk: Any) -> Any:
                r = real(t, *ta, **tk)
                if not ta and not tk and isinstance(r, str) and r.startswith("torch.") \
                        and not r.startswith("torch.cuda."):
                    return "torch.cuda." + r[len("torch."):]
                return r

            torch.Tensor.type = type_  # type: ignore[method-assign]
            try:
                return orig(*a, **k)
            finally:
                torch.Tensor.type = real  # type: ignore[method-assign]

        setattr(target, attr, kind(cuda_typed) if kind is not None else cuda_typed)

    def revert() -> None:
        if "orig" in state:
            setattr(state["target"], attr, state["orig"])

    return Patch(name, works_around, apply, revert)


def _global_default_patch(name: str, module: str, attr: str, value: Any, works_around: str) -> Patch:
    """Define a module global that mcore reads but only defines when an optional import succeeds."""
    state: dict[str, Any] = {}

    def apply() -> None:
        mod = importlib.import_module(module)
        state["had"] = hasattr(mod, attr)
        if not state["had"]:
            setattr(mod, attr, value)

    def revert() -> None:
        if state.get("had") is False:
            delattr(importlib.import_module(module), attr)

    return Patch(name, works_around, apply, revert)


def _alltoall_splits_patch() -> Patch:
    """The alltoall dispatcher hands its split sizes to ``all_to_all_single`` as numpy arrays (copied to the
    host with ``as_numpy=True``); gloo's binding takes only lists of ints."""
    state: dict[str, Any] = {}

    def as_list(x: Any) -> Any:
        return None if x is None else [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]

    def apply() -> None:
        from megatron.core.tensor_parallel.mappings import _AllToAll

        orig = state.setdefault("orig", _AllToAll.__dict__["forward"])

        def forward(ctx: Any, group: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any) -> Any:
            return orig.__func__(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes))

        _AllToAll.forward = staticmethod(forward)

    def revert() -> None:
        if "orig" in state:
            from megatron.core.tensor_parallel.mappings import _AllToAll

            _AllToAll.forward = state["orig"]

    return Patch("alltoall_split_lists", "tensor_parallel/mappings.py:444 all_to_all_single gets numpy split "
                 "sizes from transformer/moe/token_dispatcher.py:879-882 (incompatible function arguments)",
                 apply, revert)


def _uneven_gather_scatter_patch() -> Patch:
    """Expert tensor parallelism gathers and reduce-scatters tokens in uneven splits (each rank routed a
    different count). Gloo's all_gather and reduce_scatter need equal sizes: pad to the largest split, then
    cut (the reduce-scatter sums the whole padded tensor and keeps this rank's part)."""
    state: dict[str, Any] = {}

    def gather(input_: Any, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return state["gather"](input_, group, output_split_sizes, use_global_buffer)
        import torch

        from areal_cli.utils import collectives

        sizes = [int(n) for n in output_split_sizes]
        m = max(sizes)
        pad = input_.new_zeros((m, *input_.shape[1:]))
        pad[: input_.shape[0]] = input_
        bufs = [torch.empty_like(pad) for _ in sizes]
        collectives.all_gather(bufs, pad.contiguous(), group=group)
        return torch.cat([b[:n] for b, n in zip(bufs, sizes)], 0)

    def reduce_scatter(input_: Any, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if input_split_sizes is None or group.size() == 1:
            return state["scatter"](input_, group, input_split_sizes, use_global_buffer)
        from areal_cli.utils import collectives

        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        collectives.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start:start + sizes[group.rank()]].contiguous()

    def apply() -> None:
        from megatron.core.tensor_parallel import mappings

        state.setdefault("gather", mappings._gather_along_first_dim)
        state.setdefault("scatter", mappings._reduce_scatter_along_first_dim)
        mappings._gather_along_first_dim = gather
        mappings._reduce_scatter_along_first_dim = reduce_scatter

    def revert() -> None:
        if "gather" in state:
            from megatron.core.tensor_parallel import mappings

            mappings._gather_along_first_dim = state["gather"]
            mappings._reduce_scatter_along_first_dim = state["scatter"]

    return Patch("uneven_gather_scatter", "tensor_parallel/mappings.py:150, :192 all_gather/reduce_scatter of "
                 "uneven token splits (transformer/moe/token_dispatcher.py:696, :780 under expert tensor "
                 "parallelism): gloo raises 'invalid tensor size'", apply, revert)


def _rng_tracker_patch() -> Patch:
    """The default CUDA RNG tracker's ``fork()`` (attention dropout, every forward) needs a CUDA RNG
    state; mcore's inference tracker forks nothing. Dropout is 0 in RL fine-tuning, so nothing is lost."""

    def apply() -> None:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    def revert() -> None:
        from megatron.core.tensor_parallel import random as mrandom

        mrandom.initialize_rng_tracker(force_reset=True)

    return Patch("rng_tracker",
                 "tensor_parallel/random.py:282-343 CudaRNGStatesTracker.fork() via "
                 "transformer/dot_product_attention.py:217 (cuda rng state not added / "
                 "torch.cuda.get_rng_state)",
                 apply, revert)


def patches() -> list[Patch]:
    """The shim's patches, in application order (a fresh list; the module keeps the applied one)."""
    return [
        _module_torch_patch("schedules_total_tokens", "megatron.core.pipeline_parallel.schedules",
                            "pipeline_parallel/schedules.py:596, :983, :2138 total_num_tokens = "
                            "torch.zeros(..., device='cuda') in all three schedules (hit at PP=1 too)"),
        _module_torch_patch("p2p_buffers", "megatron.core.pipeline_parallel.p2p_communication",
                            "pipeline_parallel/p2p_communication.py:190-202, :313, :321 buffers on "
                            "torch.cuda.current_device(); :242, :398 torch.cuda.synchronize()"),
        _module_torch_patch("default_causal_mask", "megatron.core.transformer.utils",
                            "transformer/utils.py:35, :40 the default causal mask is built on device='cuda' "
                            "when no attention mask is passed"),
        _module_torch_patch("rotary_inv_freq", "megatron.core.models.common.embeddings.rotary_pos_embedding",
                            "models/common/embeddings/rotary_pos_embedding.py:162 inv_freq is moved to "
                            "torch.cuda.current_device() on the first forward"),
        _module_torch_patch("global_memory_buffer", "megatron.core.utils",
                            "utils.py:631 GlobalMemoryBuffer.get_tensor allocates on "
                            "torch.cuda.current_device() "
                            "(the attention score buffer, transformer/dot_product_attention.py:189)"),
        _tied_embedding_patch(),
        _rng_tracker_patch(),
        # --- the training path: DDP, optimizers, sequence parallelism
        _module_torch_patch("grad_buffers", "megatron.core.distributed.param_and_grad_buffer",
                            "distributed/param_and_grad_buffer.py:768-806 the DDP param/grad buffers are "
                            "allocated on torch.cuda.current_device()"),
        _module_torch_patch("optimizer_buffers", "megatron.core.optimizer.optimizer",
                            "optimizer/optimizer.py:473-485, :907 found_inf / loss-scale tensors on "
                            "device='cuda'"),
        _module_torch_patch("grad_norm", "megatron.core.optimizer.clip_grads",
                            "optimizer/clip_grads.py:90, :103, :115, :174 the grad norm and overflow "
                            "buffers on device='cuda'"),
        _cuda_type_names_patch("distributed_optimizer_type_check",
                               "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
                               "_build_model_and_main_param_groups",
                               "optimizer/distrib_optimizer.py:361, :420 parameters must be "
                               "torch.cuda.{Float,Half,BFloat16}Tensor"),
        _cuda_type_names_patch("float16_optimizer_type_check",
                               "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params",
                               "__init__",
                               "optimizer/optimizer.py:671, :690 parameters must be "
                               "torch.cuda.{Float,Half,BFloat16}Tensor"),
        _module_torch_patch("sequence_parallel_buffers", "megatron.core.tensor_parallel.layers",
                            "tensor_parallel/layers.py:552, :597, :607 sequence parallelism all-gathers "
                            "into buffers on torch.cuda.current_device()"),
        _module_torch_patch("sequence_parallel_mappings", "megatron.core.tensor_parallel.mappings",
                            "tensor_parallel/mappings.py:91, :141, :148, :181 sequence-parallel gather and "
                            "reduce-scatter outputs on torch.cuda.current_device()"),
        # --- MoE: the alltoall token dispatcher, the router, the aux-loss tracker
        _module_torch_patch("moe_dispatcher_streams", "megatron.core.transformer.moe.token_dispatcher",
                            "transformer/moe/token_dispatcher.py:445 torch.cuda.Stream() for the device-to-host "
                            "copies of the split sizes; :871-895 stream waits and events"),
        _global_default_patch("moe_router_gemm", "megatron.core.transformer.moe.moe_utils", "te_general_gemm", None,
                              "transformer/moe/moe_utils.py:22-38 defines te_general_gemm only when "
                              "TransformerEngine imports; :1192 the router's gating linear reads it (NameError)"),
        _alltoall_splits_patch(),
        _uneven_gather_scatter_patch(),
        _module_torch_patch("moe_router_device", "megatron.core.transformer.moe.router",
                            "transformer/moe/router.py:90, :92 the router weight is moved to "
                            "torch.cuda.current_device() on its first forward"),
    ]


_APPLIED: list[Patch] = []


def apply_cpu_compat(force: bool = False) -> list[str]:
    """Check the version, then apply every patch once when CUDA is absent. Returns the applied names
    (empty on a CUDA machine, or when already applied). ``force`` applies them even with CUDA (tests)."""
    import torch

    check_version()
    if _APPLIED or (torch.cuda.is_available() and not force):
        return []
    for p in patches():
        p.apply()
        p.applied = True
        _APPLIED.append(p)
    return [p.name for p in _APPLIED]


def revert_cpu_compat() -> None:
    """Undo :func:`apply_cpu_compat` (tests)."""
    while _APPLIED:
        p = _APPLIED.pop()
        p.revert()
        p.applied = False
