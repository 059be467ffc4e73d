"""HF <-> mcore conversion (engines/megatron/convert.py) under both layer specs the engine builds: the local one
(CPU) and megatron-core 0.16.1's TransformerEngine one (CUDA with TE), which fuses a layer's norms into the
following TE linear where there is one (qkv; a dense MLP's fc1) but keeps a separate ``pre_mlp_layernorm`` in
front of an MoE block.

TransformerEngine is not installed here, so the TE spec's model is built from mcore's own spec functions and
modules with only the TE leaf classes stood in for (:func:`_swap_te`): each stand-in is the local-spec module that
mcore calls the same way, carrying TE's parameter names (``weight``/``bias``; LayerNormLinear's
``layer_norm_weight``/``layer_norm_bias``, the names mcore's TE extension reads and its specs' key maps write).
Every other name (layers, attention, MoE router and experts, which norms exist) comes from mcore's spec and
modules, so a change there changes the key set under test. Qwen2 (dense, qkv bias, tied), Qwen3 (q/k norms) and
Qwen3-MoE (also with a first dense layer, mcore's ``moe_layer_freq`` layout) go HF checkpoint -> mcore -> HF:
the exact HF key set back, every tensor equal, and each HF norm in the mcore parameter of its own sublayer.
In-process: one gloo rank, t1 p1. Skips when megatron-core 0.16.1 is not installed.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from areal_cli.engines.megatron import compat

pytestmark = pytest.mark.skipif(compat.installed_version() != compat.SUPPORTED_VERSION,
                                reason=f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                                       "(scripts/install_test_deps.sh installs it)")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, head_dim=16)
# name: (config class, kwargs, HF layers that are dense within an MoE model)
CASES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), None),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16), None),
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, **MOE), None),
    "qwen3_moe_first_dense": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_hidden_layers=3, **MOE), [0]),
}


# ------------------------------------------------------------------------------------- TE stand-ins
def _standins() -> dict[str, object]:
    """TE extension class name -> a CPU module that mcore can build in its place with TE's parameter names."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def norm(config, hidden_size: int, eps: float):
        # TENorm.__new__ returns te.pytorch.RMSNorm (``weight``) or LayerNorm (``weight``, ``bias``)
        if config.normalization == "RMSNorm":
            return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)

    class TENormStandIn:
        def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
            return norm(config, hidden_size, eps)

    class LayerNormLinearStandIn(ColumnParallelLinear):
        """te.pytorch.LayerNormLinear: the linear's ``weight``/``bias`` and its input norm's ``layer_norm_weight``
        (plus ``layer_norm_bias`` for LayerNorm; RMSNorm has none)."""

        def __init__(self, input_size: int, output_size: int, *, config, **kw):
            super().__init__(input_size, output_size, config=config, **kw)
            n = norm(config, input_size, config.layernorm_epsilon)
            self.layer_norm_weight = n.weight
            if getattr(n, "bias", None) is not None:
                self.layer_norm_bias = n.bias

    return {"TELayerNormColumnParallelLinear": LayerNormLinearStandIn, "TEColumnParallelLinear": ColumnParallelLinear,
            "TERowParallelLinear": RowParallelLinear, "TEDotProductAttention": DotProductAttention,
            "TENorm": TENormStandIn}


def _te_objects() -> dict[str, object]:
    """The TE extension's classes by name (without TE, MagicMock subclasses; TENorm a class that refuses)."""
    import megatron.core.extensions.transformer_engine as te

    return {n: getattr(te, n) for n in dir(te) if n.startswith("TE") and getattr(te, n) is not None}


def _swap_te(obj, swap: list[tuple[object, object]]):
    """``obj`` (a ModuleSpec, block spec or submodules dataclass) with every TE class replaced by its stand-in."""
    for te_obj, standin in swap:  # first: without TE the classes are MagicMocks that pass isinstance checks
        if obj is te_obj:
            return standin
    if isinstance(obj, list):
        return [_swap_te(o, swap) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _swap_te(getattr(obj, f.name), swap)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _te_left(obj, te_ids: set[int]) -> list[object]:
    if id(obj) in te_ids:
        return [obj]
    if isinstance(obj, list):
        return [x for o in obj for x in _te_left(o, te_ids)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _te_left(getattr(obj, f.name), te_ids)]
    return []


@pytest.fixture
def te_spec(monkeypatch):
    """Make mcore's TE spec functions callable without TE (as with a TE >= 1.9, whose q/k norm is TENorm) and
    return a function that swaps the TE classes of a spec for the stand-ins (failing on any it has none for)."""
    import megatron.core.extensions.transformer_engine_spec_provider as tsp
    import megatron.core.models.gpt.gpt_layer_specs as gls
    import megatron.core.transformer.transformer_block as tb

    objs, standins = _te_objects(), _standins()
    assert len({id(o) for o in objs.values()}) == len(objs), "TE classes are not distinct objects"
    swap = [(objs[n], s) for n, s in standins.items()]
    monkeypatch.setattr(gls, "TESpecProvider", tsp.TESpecProvider, raising=False)
    monkeypatch.setattr(gls, "TENorm", objs["TENorm"], raising=False)
    monkeypatch.setattr(tsp, "is_te_min_version", lambda *a, **k: True)
    # a layer ModuleSpec's block gets TENorm as its final norm when TE imports (transformer_block.py:54-61)
    monkeypatch.setattr(tb, "LayerNormImpl", standins["TENorm"])

    def swapped(spec):
        out = _swap_te(spec, swap)
        left = _te_left(out, {id(o) for o in objs.values()})
        assert not left, f"TE classes without a stand-in in the spec: {left}; add them to _standins"
        return out

    return swapped


# ------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def mcore_world():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    applied = compat.apply_cpu_compat()  # MoELayer's dispatcher makes a CUDA stream as it is built
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if torch.cuda.is_available():  # mcore initialises on the GPU there, inside its model-parallel RNG state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    yield
    mpu.destroy_model_parallel()
    if applied:
        compat.revert_cpu_compat()
    if own:
        dist.destroy_process_group()


def _hf_checkpoint(case: str, out_dir) -> tuple[object, dict[str, torch.Tensor]]:
    """The case's HF config and checkpoint tensors (as save_pretrained writes them: per-expert for MoE), with
    norms and biases made distinct so that a norm converted into the wrong place shows."""
    import transformers

    from areal_cli.weight_sync.hf_io import HFCheckpoint

    cls, kw, dense = CASES[case]
    cfg = getattr(transformers, cls)(**{**COMMON, **kw, **({"mlp_only_layers": dense} if dense else {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p))
    model.save_pretrained(str(out_dir))
    ck = HFCheckpoint(out_dir)
    return cfg, {n: ck.get(n) for n in ck.names()}


def _build(case: str, cfg, spec: str, swap, monkeypatch) -> tuple[object, object]:
    """(HFArch, the one GPTModel chunk) as engines/megatron/model.build_chunks builds it for ``spec``; a first
    dense layer uses mcore's own mixed-layout block spec (``moe_layer_freq``), which model.py does not build."""
    from megatron.core.models.gpt import gpt_layer_specs as gls

    from areal_cli.engines.megatron import model as mm

    dense = CASES[case][2]
    if dense:  # hf_arch refuses dense layers in an MoE model (model.py builds every layer alike)
        cfg = copy.deepcopy(cfg)
        cfg.mlp_only_layers = []
    arch = mm.hf_arch(cfg)
    config = mm.transformer_config(arch)
    use_te = spec == "te"
    if dense:
        config.moe_layer_freq = [int(i not in dense) for i in range(arch.num_layers)]
        monkeypatch.setattr(mm, "_block_spec", lambda layer, c, vp, te: (swap or (lambda s: s))(
            gls.get_gpt_decoder_block_spec(c, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp)))
    elif use_te:
        real = mm.layer_spec
        monkeypatch.setattr(mm, "layer_spec", lambda a, te, *rest: swap(real(a, te, *rest)))
    torch.manual_seed(1)
    (chunk,) = mm.build_chunks(arch, config, use_te=use_te)
    return arch, chunk


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("case", list(CASES))
def test_hf_mcore_hf_round_trip(case, spec, mcore_world, te_spec, monkeypatch, tmp_path):
    from areal_cli.engines.megatron import convert

    cfg, hf = _hf_checkpoint(case, tmp_path)
    arch, chunk = _build(case, cfg, spec, te_spec if spec == "te" else None, monkeypatch)
    convert.load_hf([chunk], hf, arch, 0, 1)  # raises on any mcore parameter left unloaded or unknown
    back = convert.mcore_to_hf([chunk], arch, None, 1)
    assert back.keys() == hf.keys(), f"only HF: {sorted(hf.keys() - back.keys())}, only back: " \
                                     f"{sorted(back.keys() - hf.keys())}"
    for k in hf:
        assert torch.equal(back[k].cpu(), hf[k]), k

    dense = CASES[case][2] or ([] if arch.num_experts else list(range(arch.num_layers)))
    params = {k: v.detach().cpu() for k, v in chunk.named_parameters()}
    for i, layer in enumerate(chunk.decoder.layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        fused = spec == "te"  # TE: input norm in linear_qkv; pre-MLP norm in a dense fc1, its own module in MoE
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"
        mlp_norm = ("mlp.linear_fc1.layer_norm_weight" if fused and i in dense else "pre_mlp_layernorm.weight")
        assert torch.equal(params[m + in_norm], hf[p + "input_layernorm.weight"]), (i, in_norm)
        assert torch.equal(params[m + mlp_norm], hf[p + "post_attention_layernorm.weight"]), (i, mlp_norm)
        assert (m + "mlp.router.weight" in params) == (i not in dense)
        for q in ("q", "k") if arch.qk_norm else ():
            assert torch.equal(params[m + f"self_attention.{q}_layernorm.weight"], hf[p + f"self_attn.{q}_norm.weight"])


@pytest.mark.parametrize("case", ["qwen2", "qwen3"])
def test_te_standins_give_the_names_mcore_maps_the_local_spec_to(case, mcore_world, te_spec, monkeypatch, tmp_path):
    """mcore's local dense layer spec declares how its keys map onto the TE spec's fused ones
    (``sharded_state_dict_keys_map``: ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ...):
    the stand-in model's keys are exactly the local model's keys under that map."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg, _ = _hf_checkpoint(case, tmp_path)
    keys = {}
    for spec in ("local", "te"):
        _, chunk = _build(case, cfg, spec, te_spec if spec == "te" else None, monkeypatch)
        keys[spec] = {k for k in chunk.state_dict() if not k.endswith("_extra_state")}
    rename = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    assert rename, "mcore's local spec no longer declares its TE key map"

    def mapped(k: str) -> str:
        head, sep, rest = k.partition("decoder.layers.")
        if not sep:
            return k
        idx, _, tail = rest.partition(".")
        for a, b in rename.items():
            if tail.startswith(a):
                tail = b + tail[len(a):]
        return f"{head}decoder.layers.{idx}.{tail}"

    assert {mapped(k) for k in keys["local"]} == keys["te"]
