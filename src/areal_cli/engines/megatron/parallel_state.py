"""Who holds megatron-core's parallel state in a trainer process.

mcore keeps its process groups in process-global state (``megatron.core.parallel_state``): every megatron
engine of one process (a policy, its KL reference, a critic, a teacher) runs on the same groups, and only the
last of them may destroy them. :class:`ParallelState` is that sharing made explicit: the first engine creates
one, each later engine is handed its peers (``initialize(..., peers=[...])``, trainer/build.py) and joins
their object, and nothing module-level counts the engines.
"""

from __future__ import annotations

from typing import Any

from areal_cli.errors import ConfigError


class ParallelState:
    """mcore's process groups and the engines of this process using them (``engines``, in join order)."""

    def __init__(self) -> None:
        self.engines: list[Any] = []
        self.layout: tuple[int, int, int] | None = None  # (t, p, e) the groups were made for

    @staticmethod
    def of(peers: Any) -> ParallelState | None:
        """The state a peer engine of this process already holds (None: no peer runs megatron)."""
        for p in peers or ():
            state = getattr(p, "parallel_state", None)
            if isinstance(state, ParallelState) and state.engines:
                return state
        return None

    def join(self, engine: Any, tp: int, pp: int, vpp: int, ep: int = 1, etp: int | None = None) -> int:
        """Add ``engine``: the first creates mcore's groups, later ones must ask for the same layout.
        Returns the engine's tensor-parallel rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if self.engines:
            if self.layout != (tp, pp, ep):
                t, p, e = self.layout
                raise ConfigError("allocation_mode.spec", f"this process already runs megatron at t{t}p{p}e{e}; "
                                  f"another engine asks for t{tp}p{pp}e{ep}",
                                  "give every megatron engine of one trainer the same t, p and e")
        elif mpu.model_parallel_is_initialized():
            # a caller bug, not a user's: an engine built without the peers that hold the groups
            raise RuntimeError("megatron-core's parallel state is already initialised by something other than "
                               "this engine's peers; pass the live megatron engines as initialize(peers=...)")
        else:
            if dist.get_world_size() % (tp * pp):
                raise ConfigError("allocation_mode.spec", f"t{tp} × p{pp} does not divide the "
                                  f"{dist.get_world_size()} trainer processes", "make d × t × p the world size")
            from areal_cli.api.io_struct import ParallelStrategy

            # The order the plan prints and placement read (api/parallel_dims.py RANK_ORDERS; set by e, p only):
            # tp fastest, pp before dp so a replica's t·p ranks share a node; pp-last when experts meet stages.
            order = ParallelStrategy(tp=tp, pp=pp, ep=ep).dims("megatron").rank_order
            mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                          order=order)
            self.layout = (tp, pp, ep)
        self.engines.append(engine)
        return mpu.get_tensor_model_parallel_rank()

    def leave(self, engine: Any) -> None:
        """Drop ``engine``; the last one takes mcore's groups with it, so a later engine may run another layout."""
        if engine not in self.engines:
            return
        self.engines.remove(engine)
        if not self.engines:
            from megatron.core import parallel_state as mpu

            mpu.destroy_model_parallel()
            self.layout = None
