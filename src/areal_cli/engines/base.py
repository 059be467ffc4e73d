"""The shared engine base: what every training backend has in common, written once.

:class:`EngineBase` owns, for FSDP, Archon, Megatron and DeepSpeed alike:

- **micro-batching and the loss normalisation**: the batch is cut into token-budget bins (the same
  count on every data-parallel rank, padded with zero-weight micro-batches), each micro-batch loss is
  scaled by ``weight / global weight`` (see :mod:`areal_cli.api.engine_api`), and the step's stats are
  reduced over the data-parallel ranks;
- **the HF checkpoint**: a model dir read one tensor (or one shard of a tensor) at a time through
  :class:`~areal_cli.weight_sync.hf_io.HFCheckpoint`, and the HF export written as tensors arrive through
  :func:`~areal_cli.weight_sync.hf_io.stream_hf_dir`: no rank holds the whole model;
- **the senders' tensor stream**: weight sync pulls the same ``(name, tensor | None)`` stream as the export
  (:meth:`_named_full_tensors`, the one method each backend must write for it), disk or broadcast, with
  the LoRA adapter alone under LoRA;
- the policy version, ``dp_all_reduce`` and ``destroy``.

A backend implements ``initialize``, ``train_batch``, ``forward``, :meth:`_named_full_tensors`,
:meth:`_load_hf` and its own checkpoint (:meth:`_save_dcp`, :meth:`_load_dcp`); the layout accessors read
``self._meshes`` (a :class:`~areal_cli.engines.parallelize.Meshes`) unless overridden. It never inherits
another backend's optimizer, forward or checkpoint code: HF-module backends share theirs through
:class:`~areal_cli.engines.hf_model.HFModelEngine`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from areal_cli.api.engine_api import Batch, TrainEngine
from areal_cli.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal_cli.engines import lora as lora_mod, packing, token_logprobs
from areal_cli.errors import ConfigError, WeightSyncError
from areal_cli.utils import collectives, host_memory
from areal_cli.weight_sync.adapter_files import ADAPTER_SUBDIR, write_adapter_dir
from areal_cli.weight_sync.outbox import Outbox

if TYPE_CHECKING:
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.config.model import LoRAConfig

VALUE_HEAD_FILE = "value_head.safetensors"


def init_value_head(head: Any) -> None:
    """A new critic's value head starts at zero (weight and bias), so every value is 0 until the critic has
    learnt: GAE's first advantages are then the whitened returns, not the noise of a random head. A head drawn
    with std 1/sqrt(hidden+1) on normalised hidden states gives values of std ~1 per token, larger than a 0/1
    reward's spread, and at a small ``critic_lr`` it stays that way for hundreds of steps (``algo=ppo`` on the
    embedded task lost accuracy). OpenAI's lm-human-preferences zero-initialises its value head too (Huang et al.,
    "The N Implementation Details of RLHF with PPO", ICLR blog track 2024)."""
    import torch

    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)


class EngineBase(TrainEngine):
    def __init__(self, engine_cfg: EngineConfig, optim_cfg: OptimConfig | None = None, *,
                 total_steps: int = 1, seed: int = 0, critic: bool = False, lora: LoRAConfig | None = None):
        """``lora``: ``model.lora`` (rank > 0 trains a peft adapter on the frozen model; engines/lora.py)."""
        self.cfg = engine_cfg
        self.lora_cfg = lora
        self.peft_config = None
        self.optim_cfg = optim_cfg
        self.total_steps = total_steps
        self.seed = seed
        self.critic = critic
        self.model = None
        self.optimizer = None
        self.scheduler = None
        self.step = 0
        self._version = 0
        self._meshes = None
        self._outbox = Outbox()  # the weight-sync senders of this engine (weight_sync/outbox.py)
        self.model_path = ""
        self.pad_token_id = 0
        self.generation_config = None

    # ------------------------------------------------------------------ the model dir
    def _check_model_dir(self, model_path: str) -> None:
        if not (Path(model_path) / "config.json").is_file():
            raise ConfigError("model.path", f"{model_path} is not an HF model dir (no config.json)",
                              "point model.path at a local dir with config.json and safetensors")

    def _read_model_meta(self, model_path: str):
        """The HF config of ``model_path`` and what export needs from the dir (architectures, generation
        config, pad id), without reading a weight. Returns the config."""
        from transformers import AutoConfig, GenerationConfig

        self._check_model_dir(model_path)
        cfg = AutoConfig.from_pretrained(model_path)
        from areal_cli.engines.vision import text_config

        self.pad_token_id = getattr(text_config(cfg), "pad_token_id", None) or 0
        self.arch = list(getattr(cfg, "architectures", None) or [_causal_lm_class(cfg)])
        # as from_pretrained: the dir's generation config, else one derived from the model config
        if (Path(model_path) / "generation_config.json").is_file():
            self.generation_config = GenerationConfig.from_pretrained(model_path)
        else:
            self.generation_config = GenerationConfig.from_model_config(cfg)
        return cfg

    def _checkpoint(self, path: str, untie: bool = True):
        """The weights of an HF dir as a lazy reader (a critic's value head as ``lm_head.*``); ``untie``: a
        tied model's head reads as the embedding (what a module tree with both names wants)."""
        from areal_cli.weight_sync.hf_io import HFCheckpoint

        ck = HFCheckpoint(path, tied_head=untie and not self.critic)
        if self.critic:
            ck.drop("lm_head.")  # an untied LM's vocab projection is not the critic's head
            ck.add_file(Path(path) / VALUE_HEAD_FILE, prefix="lm_head.")
        return ck

    # ------------------------------------------------------------------ layout
    @property
    def dp_group(self):
        return self._meshes.dp_group if self._meshes else None

    @property
    def cp_group(self):
        return self._meshes.cp_group if self._meshes else None

    @property
    def dp_rank(self) -> int:
        return self._meshes.dp_rank if self._meshes else 0

    @property
    def dp_world_size(self) -> int:
        return self.parallel.dp if self._meshes else 1

    @property
    def is_dp_head(self) -> bool:
        return self._meshes is None or self._meshes.cp_rank == 0

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)

    # ------------------------------------------------------------------ micro-batches
    @staticmethod
    def _broadcast_batch(batch: Batch | None, group, src: int) -> Batch:
        """Every rank of ``group`` gets ``src``'s batch (the replica's head holds it)."""
        obj = [None if batch is None else {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                           for k, v in batch.items()}]
        return collectives.broadcast_object_list(obj, src=src, group=group)[0]

    def _share_batch(self, batch: Batch | None) -> Batch:
        """Give every rank of a Ulysses group the head's batch."""
        if self.parallel.cp > 1:
            batch = self._broadcast_batch(batch, self.cp_group, dist.get_global_rank(self.cp_group, 0))
        if batch is None:
            raise ValueError("train_batch/forward: the data-parallel head must pass a batch")
        return batch

    def _seq_multiple(self) -> int:
        """Every packed forward's length is a multiple of this (Ulysses splits the sequence over cp)."""
        return self.parallel.cp

    def _shares_prefix(self, output: str) -> bool:
        return False

    def _logprobs_entropy(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          cutoffs: torch.Tensor | None = None):
        """``cutoffs``: Keep-Sampling-Mask thresholds aligned with ``targets`` (see engines/sampling_mask.py).
        Chunked and fused (engines/token_logprobs.py): no vocabulary-sized temporaries beyond the logits."""
        return token_logprobs.logprobs_entropy(logits, targets, temperature,
                                               None if cutoffs is None else cutoffs.to(logits.device))

    def _split(self, batch: Batch, output: str) -> tuple[list[list[int]], int]:
        lens = packing.seq_lens(batch)
        if self._shares_prefix(output):
            bins = packing.prefix_bins(batch, self.cfg.max_tokens_per_mb)
        else:
            bins = packing.ffd_bins(lens, self.cfg.max_tokens_per_mb)
        n = torch.tensor([len(bins)], dtype=torch.long)
        if self.dp_world_size > 1:
            n = self._all_reduce(n, collectives.ReduceOp.MAX)
        n_mb = int(n.item())
        return packing.equalize_bins(bins, lens, n_mb), n_mb

    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the data-parallel ranks (a new tensor on ``t``'s device; identity at dp=1):
        the reducer ``PPOActor`` needs for batch-level statistics over sharded batches."""
        return self._all_reduce(t.detach().clone()).to(t.device)

    def _all_reduce(self, t: torch.Tensor, op=collectives.ReduceOp.SUM) -> torch.Tensor:
        """``t`` reduced in place over the data-parallel ranks (host statistics: the helper takes them
        through the group's CPU backend, or stages them on the GPU for an NCCL-only group)."""
        if self.dp_world_size == 1:
            return t
        return collectives.all_reduce(t, op=op, group=self.dp_group)

    def _dummy_mb(self) -> Batch:
        # Two tokens: position 1 has an output, so the zero loss is still connected to every parameter
        # (a one-token row has no prediction, its zero loss no graph, and its backward would fail).
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                "loss_mask": torch.zeros_like(ids, dtype=torch.float32)}

    def _weighted_micro_batches(self, batch: Batch, loss_weight_fn, output: str,
                                to_device: bool = False) -> tuple[list[Batch], list[float], float, int]:
        """This replica's micro-batches, the loss weight of each, the global weight (summed over the
        data-parallel ranks; 1 when that is 0) and the step's micro-batch count (the largest over the ranks:
        a rank with fewer pads with zero-weight micro-batches)."""
        bins, n_mb = self._split(batch, output)
        mbs = [packing.select_rows(batch, b) for b in bins]
        if to_device:
            mbs = [{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
                   for mb in mbs]
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        total_w = float(self._all_reduce(torch.tensor([sum(weights)], dtype=torch.float64)).item())
        return mbs, weights, (total_w if total_w > 0 else 1.0), n_mb

    def _reduce_stats(self, loss_sum, stat_sums, denom, grad_norm, lr, n_mb) -> dict[str, float]:
        keys = sorted(stat_sums)
        if self.dp_world_size > 1:
            all_keys: list = [None] * self.dp_world_size
            collectives.all_gather_object(all_keys, keys, group=self.dp_group)
            keys = sorted(set().union(*all_keys))
        vec = torch.tensor([loss_sum] + [stat_sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        vec = self._all_reduce(vec)
        out = {"loss": float(vec[0]), "grad_norm": grad_norm, "lr": float(lr), "n_micro_batches": float(n_mb),
               "loss_weight": float(denom)}
        out.update({k: float(vec[j + 1]) / denom for j, k in enumerate(keys)})
        return out

    def _check_output(self, output: str) -> tuple[str, ...]:
        """The keys ``forward(output=…)`` returns; a clear error for an output this engine cannot give."""
        if output not in ("logprobs", "values"):
            raise ValueError(f"output must be 'logprobs' or 'values', got {output!r}")
        if output == "values" and not self.critic:
            raise ValueError("forward(output='values') needs an engine built with critic=True")
        return ("values",) if output == "values" else ("logprobs", "entropy")

    @staticmethod
    def _place_rows(batch: Batch, bins: list[list[int]], results: dict, keys: tuple[str, ...]) -> dict:
        """Per-micro-batch outputs ``results[i]`` (rows ``bins[i]``, trimmed lengths) back into ``[B, L]``."""
        B, L = batch["input_ids"].shape
        res = {k: torch.zeros(B, L, dtype=torch.float32) for k in keys}
        for i, rows in enumerate(bins):
            idx = torch.tensor(rows)
            for k in keys:
                res[k][idx, : results[i][k].shape[1]] = results[i][k].float()
        return res

    # ------------------------------------------------------------------ full weights
    def _named_full_tensors(self, include_value_head: bool = True, to_cpu: bool = True, keep=None):
        """``(name, full tensor)`` on global rank 0 and ``(name, None)`` elsewhere, in the same order on every
        rank (gathering a shard is a collective), one tensor at a time. ``keep(name)``: only those names."""
        raise NotImplementedError

    def _write_hf(self, path: str, named) -> None:
        """Stream ``(name, tensor | None)`` pairs into an HF dir (rank 0's pairs carry the tensors); a
        critic's value head goes to its own file."""
        from areal_cli.weight_sync.hf_io import stream_hf_dir

        head: dict[str, torch.Tensor] = {}

        def body():
            for name, t in named:
                if self.critic and name.startswith("lm_head."):
                    if t is not None:
                        head[name.split(".", 1)[1]] = t
                    continue
                yield name, t

        cfg = self.hf_config
        if self.critic:
            cfg = cfg.__class__.from_dict(cfg.to_dict())
            cfg.tie_word_embeddings = _orig_tie(self.model_path)
        from areal_cli.engines.parallelize import torch_dtype

        stream_hf_dir(path, body(), cfg, architectures=self.arch, tokenizer_src=self.model_path,
                      generation_config=self.generation_config, dtype=torch_dtype(self.cfg.dtype))
        if head:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in head.items()}, str(Path(path) / VALUE_HEAD_FILE))

    def _export_tensors(self, to_cpu: bool = True):
        """The model as HF tensors: under LoRA with the adapter merged into the base weights."""
        named = self._named_full_tensors(to_cpu=to_cpu)
        return lora_mod.merged_stream(named, self.peft_config) if self.peft_config is not None else named

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's full tensors on global rank 0 (``{}`` elsewhere); collective."""
        return {n: t for n, t in self._named_full_tensors(keep=lora_mod.is_lora_name) if t is not None}

    # ------------------------------------------------------------------ checkpoints
    def save(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format == "hf":
            self._save_hf(meta)
        elif meta.weight_format == "dcp":
            self._save_dcp(meta)
        else:
            raise ConfigError("save.weight_format", f"unknown format {meta.weight_format!r}", "use hf or dcp")

    def _save_hf(self, meta: SaveLoadMeta) -> None:
        """Every rank drives the stream (its gathers are collectives); rank 0 writes as tensors arrive."""
        named = self._export_tensors()
        if dist.get_rank() == 0:
            self._write_hf(meta.path, named)
        else:
            for _ in named:
                pass
        adapter = self.adapter_tensors() if self.peft_config is not None else {}
        if dist.get_rank() == 0:
            if meta.tokenizer_path:
                from areal_cli.weight_sync.hf_io import copy_tokenizer

                copy_tokenizer(meta.tokenizer_path, meta.path)
            if adapter:  # beside the merged model: the adapter alone, in peft's layout
                write_adapter_dir(Path(meta.path) / ADAPTER_SUBDIR, adapter, self.peft_config)
        host_memory.release()  # the gathered tensors' heap pages
        collectives.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        """``dcp``: restore model, optimizer, scheduler, step and version; the saved ``extra_state`` is merged
        into ``meta.extra_state``. ``hf``: load full weights only."""
        if meta.weight_format == "hf":
            self._load_hf(meta.path)
        else:
            self._load_dcp(meta)

    def _save_dcp(self, meta: SaveLoadMeta) -> None:
        raise NotImplementedError

    def _load_dcp(self, meta: SaveLoadMeta) -> None:
        raise NotImplementedError

    def _load_hf(self, path: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, meta: WeightUpdateMeta, engines: list, loop=None) -> None:
        """Push weights to ``engines`` (pause → sync → continue) and set the version on both sides.

        The pushed version is ``meta.version`` when it is > 0, else ``get_version() + 1``. Only global
        rank 0 talks to servers; every trainer rank must call this (gathering shards is collective).
        ``loop``: the event loop that owns the clients (default: a private one). Under LoRA only the
        adapter is pushed (weight_sync/lora.py); the servers keep the base weights.
        """
        if self.critic:
            raise WeightSyncError("weight sync: a critic engine has no policy weights to push")
        if meta.backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("weight_sync.backend", "nccl needs CUDA but this trainer has no GPU",
                              "use backend=gloo on CPU hosts")
        version = meta.version if meta.version > 0 else self._version + 1
        self._sync_weights(dataclasses.replace(meta, version=version), engines, loop)

    def push_adapter(self, meta: WeightUpdateMeta, engines: list, loop=None) -> None:
        """Under LoRA: load the current adapter into ``engines`` at exactly ``meta.version`` (0 included),
        for start-up, resume and restarted servers, which hold the base weights and no adapter yet."""
        if self.peft_config is None:
            raise WeightSyncError("push_adapter: this engine trains no LoRA adapter (model.lora.rank=0)")
        self._sync_weights(meta, engines, loop)

    def _sync_weights(self, meta: WeightUpdateMeta, engines: list, loop=None) -> None:
        version = meta.version
        n_servers = sum(len(c.addresses) for c in engines) or len(engines)
        meta = dataclasses.replace(meta, version=version, world_size=meta.world_size or 1 + n_servers)
        adapter = (self.adapter_tensors, self.peft_config) if self.peft_config is not None else None
        self._outbox.send(meta, engines, loop=loop, write_dir=self._write_hf, adapter=adapter, device=self.device,
                          full=lambda to_cpu: self._named_full_tensors(to_cpu=to_cpu))
        self._version = version
        for c in engines:
            c.set_version(version)

    @property
    def _senders(self) -> dict[str, Any]:
        """The senders by kind (``benchmarks/weight_sync.py`` installs its baseline sender here)."""
        return self._outbox.senders

    @property
    def last_sync_seconds(self) -> dict[str, float]:
        """Phase timings of the last weight sync on rank 0 (for benchmarks and logs)."""
        return self._outbox.last_seconds

    def destroy(self) -> None:
        self._outbox.close()


def _causal_lm_class(cfg) -> str:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)].__name__


def _orig_tie(model_path: str) -> bool:
    import json

    try:
        return bool(json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False

