"""Plain data structures shared by the inference, training and rollout layers.

Import-light on purpose: nothing here imports torch at module import time, so the CLI can use
these types while staying instant.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_cli.api.parallel_dims import ParallelDims

StopReason = Literal["stop", "length", "abort"]


@dataclass
class GenerationConfig:
    """Sampling settings for one request (one sample; ``n`` is expanded by the caller/workflow).

    Logprob convention (shared by every server and the trainer): ``output_logprobs[i]`` is
    ``log softmax(logits / temperature)[token_i]`` *before* top-p/top-k truncation, i.e. the
    log-probability under the distribution the trainer recomputes with the same temperature.
    With ``greedy=True`` temperature is treated as 1.0 for logprobs.

    ``keep_sampling_mask`` (Keep-Sampling-Mask, ``hf`` server only): the response also carries each
    token's top-k/top-p kept set (``ModelResponse.sampling_cutoffs``) and its ``output_logprobs`` are
    then under the truncated, renormalised distribution the token was drawn from (the behaviour policy).

    ``return_routed_experts`` (routing replay, MoE models; SGLang's request field): the response also
    carries the experts each MoE layer routed every fed token to (``ModelResponse.routed_experts``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    greedy: bool = False
    # Per-request sampling seed (SGLang ``sampling_seed``, vLLM ``seed``): the same seed, prompt
    # and weights give the same tokens regardless of batching. None: the server's own RNG stream.
    seed: int | None = None
    keep_sampling_mask: bool = False
    return_routed_experts: bool = False

    def new(self, **kwargs: Any) -> "GenerationConfig":
        return dataclasses.replace(self, **kwargs)


@dataclass
class ModelRequest:
    """One generation request: a prompt as token ids plus sampling settings."""

    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = field(default_factory=dict)
    # Routing key: every request with one key goes to the server that served it before while that one
    # is healthy, so the server's prefix cache holds its earlier turns (an agent session's id; a GRPO
    # group's id for its members). None: routed by load alone.
    session_id: str | None = None
    # Images of a vision-language prompt, in prompt order: data URLs (``data:image/png;base64,...``), bare
    # base64, or paths the server may read. Each is one run of image-pad ids in ``input_ids`` (one pad,
    # expanded by the server, or the processor's exact count); the response's ``input_tokens`` are then
    # the expanded prompt the model saw when the server reports it (the hf server does). docs/vision.md.
    image_data: list[str] | None = None
    # The image placeholder's id (Qwen2-VL's <|image_pad|>) when ``image_data`` is set: a backend that takes one
    # pad per image (SGLang, which expands each itself) sends each pad run as one pad (backends/sglang.py).
    image_pad_id: int | None = None


@dataclass
class ModelResponse:
    """Result of one request. Lists are aligned per generated token.

    ``output_versions[i]`` is the policy (weight) version that produced token ``i``; a response
    that was aborted by a weight update and resumed therefore spans versions.
    """

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0  # seconds, submit → final token
    ttft: float = 0.0  # seconds to first token
    n_resumes: int = 0  # abort→resume cycles the client performed
    server: str = ""  # address that produced the final segment
    # Keep-Sampling-Mask: per token, the kept set is every token with ``logits / T >= cutoff`` (-inf:
    # nothing was cut). None unless the request asked for it (``GenerationConfig.keep_sampling_mask``).
    sampling_cutoffs: list[float] | None = None
    # Routing replay: an int16 tensor ``[input_len + output_len - 1, n_moe_layers * top_k]``, the top-k
    # experts of every token the server fed through the model (all but the last), layer-major; a resumed
    # request keeps each position's first recording. None unless ``GenerationConfig.return_routed_experts``.
    routed_experts: Any = None

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class ParallelStrategy:
    """Sizes of each parallel dimension for one training component.

    ``dp`` data, ``tp`` tensor, ``pp`` pipeline, ``cp`` context (Ulysses sequence parallel), ``ep``
    expert (does not add devices: experts are cut over ep of the dp×cp ranks), ``etp`` the tensor-parallel
    size inside each expert (0: the same as ``tp``; the ffn part of a hybrid MoE spec sets it). World size =
    dp*tp*pp*cp.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 0

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def dims(self, engine: str | None = None) -> ParallelDims:
        """These sizes as :class:`ParallelDims`, with ``engine``'s rank order (None: the default one)."""
        return ParallelDims.from_strategy(self, engine)


@dataclass
class WeightUpdateMeta:
    """How the trainer pushes weights to inference servers.

    ``type="disk"``: the trainer writes a HF-layout safetensors dir at ``path`` and servers load it.
    ``type="distributed"``: trainer rank 0 (group rank 0) and every server (ranks 1..N, in server
    order) join a dedicated process group at ``master_address:master_port`` and tensors are
    broadcast in buckets of at most ``bucket_bytes`` (SGLang's ``init_weights_update_group`` /
    ``update_weights_from_distributed`` protocol).
    """

    type: Literal["disk", "distributed"] = "disk"
    version: int = 0
    path: str | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_name: str = "areal_weight_update"
    backend: Literal["gloo", "nccl"] = "gloo"
    world_size: int = 0  # 1 (trainer) + number of server ranks
    bucket_bytes: int = 256 * 1024 * 1024
    dtype: str = "float32"  # dtype on the wire for distributed updates ("bfloat16" halves traffic)
    timeout_s: float = 120.0


@dataclass
class ParamSpec:
    """Name, dtype and shape of one tensor in a distributed weight-update bucket."""

    name: str
    dtype: str
    shape: list[int]


@dataclass
class SaveLoadMeta:
    """Where and what to save/load.

    ``weight_format="hf"`` writes an HF-loadable dir (safetensors + config + tokenizer);
    ``"dcp"`` writes resumable sharded state (model, optimizer, scheduler, step, version); the process's
    RNG state is the trainer checkpoint's (``trainer/checkpoint.py``), not an engine's.
    """

    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer_path: str | None = None
    extra_state: dict[str, Any] = field(default_factory=dict)
