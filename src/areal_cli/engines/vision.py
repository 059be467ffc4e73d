"""Vision-language models (Qwen2.5-VL, Qwen2-VL) in the HF-module engines (fsdp, archon): images in, names out.

A batch row carries its images in ``batch["multi_modal"]`` (:data:`KEY`; the contract is in
:mod:`areal_cli.api.engine_api`): ``None`` for a text row, else ``{"pixel_values" [n_patches, patch_dim],
"image_grid_thw" [n_images, 3]}`` as the processor returns them, with the row's ``input_ids`` already
holding the expanded ``<|image_pad|>`` tokens.

What the engines do with it:

- **positions**: the Qwen2-VL family's mrope positions ``[3, ...]`` of each row, from the model's own
  ``get_rope_index`` on that row's tokens and grids (:func:`row_positions`), placed along the packed row
  (:func:`packed_positions`) or the padded batch (:func:`padded_positions`). A packed row keeps its
  block-diagonal attention exactly as a text one: the mask (or the per-sequence layout) comes from the
  sequence lengths, never from the positions.
- **image features**: the tower runs *inside* the model's forward, from a forward hook on the language
  model's token embedding (:func:`install`), which writes the merged image features over the image tokens
  of the embedding's output. Inside the forward, FSDP has gathered the root's parameters and gathers the
  tower's as it runs; under Ulysses (``cp``) or sequence parallelism (archon ``t``) the embedding holds a
  slice of the packed row, and the hook writes that slice's features only. The tower is not cut over
  ``t``: every tensor-parallel rank runs all of it and the features' gradient is summed over ``t``
  (:class:`_SumGradOverGroup`), so every rank's tower gradient is the whole one.
- **every forward runs the tower** on a VL model, on a one-token blank image when the micro-batch has no
  image: its FSDP gathers and gradient reductions are collectives, and a data-parallel rank whose
  micro-batch is all text must take part in them (its contribution is multiplied by zero).
- **names**: the module tree is transformers 5's (``model.visual.*``, ``model.language_model.*``); the
  checkpoint, HF export and weight sync use the hub's layout (``visual.*``, ``model.*``): :func:`hub_name`.
"""

from __future__ import annotations

from typing import Any

import torch

KEY = "multi_modal"
VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
_PENDING = "_areal_vision_pending"
_HOOKED = "_areal_vision_hooked"


# ------------------------------------------------------------------ config and module tree
def is_vl_config(cfg: Any) -> bool:
    return getattr(cfg, "model_type", None) in VL_MODEL_TYPES and getattr(cfg, "vision_config", None) is not None


def text_config(cfg: Any) -> Any:
    """The language model's config (head counts, vocabulary, hidden size live there in a VL config)."""
    return cfg.get_text_config() if is_vl_config(cfg) else cfg


def hub_name(name: str) -> str:
    """The hub checkpoint's name of a module-tree parameter of a VL model (others unchanged)."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def text_model(model: Any) -> Any:
    """The decoder stack (``.embed_tokens``, ``.layers``, ``.norm``): ``model.model`` of a causal LM,
    ``model.model.language_model`` of a VL model."""
    base = getattr(model, "model", model)
    return getattr(base, "language_model", base)


def tower(model: Any) -> Any:
    """The vision tower of a VL model, else None."""
    return getattr(getattr(model, "model", None), "visual", None)


def tower_units(model: Any) -> list:
    """The tower's FSDP units, innermost first: each ViT block, then the tower (patch embedding, merger)."""
    t = tower(model)
    return [] if t is None else [*t.blocks, t]


def freeze_tower(model: Any) -> int:
    """``requires_grad=False`` on every tower parameter (the optimizer is built over trainable ones only);
    returns how many were frozen."""
    t = tower(model)
    n = 0
    for p in ([] if t is None else t.parameters()):
        p.requires_grad_(False)
        n += 1
    return n


def attn_impls(text_impl: str, engine_impl: str) -> dict[str, str]:
    """``attn_implementation`` per sub-config: the engine's (Ulysses-aware, packed) attention for the
    language model; transformers' own for the tower, which attends bidirectionally within each image
    (window) from its own ``cu_seqlens``, with no sequence parallelism and no packed-row layout."""
    tower_impl = "eager" if engine_impl == "eager" else "sdpa"
    return {"": text_impl, "text_config": text_impl, "vision_config": tower_impl}


# ------------------------------------------------------------------ rows
def has_images(mb: dict) -> bool:
    return any(e is not None for e in (mb.get(KEY) or ()))


def _entries(mb: dict) -> list:
    mm = mb.get(KEY)
    return list(mm) if mm is not None else [None] * int(mb["input_ids"].shape[0])


def token_types(ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    """``mm_token_type_ids``: 1 on image tokens, 2 on video tokens, 0 elsewhere (what a plain HF forward of a
    processor's output needs: without it transformers 5.24's Qwen2.5-VL falls back to 1-D positions)."""
    tt = (ids == int(cfg.image_token_id)).int()
    vid = getattr(cfg, "video_token_id", None)
    if vid is not None:
        tt = tt + 2 * (ids == int(vid)).int()
    return tt


def row_image_tokens(ids: torch.Tensor, grid: torch.Tensor | None, cfg: Any) -> torch.Tensor:
    """``[n]`` bool: the row's image tokens that hold its images' features, the first ``sum(t*h*w) / merge^2``
    ``<|image_pad|>`` of the row (the prompt's, expanded by the processor). A pad the policy generated later
    in the row has no picture: it stays a text token (its own embedding, 1-D position)."""
    is_pad = ids == int(cfg.image_token_id)
    if grid is None:
        return torch.zeros_like(is_pad)
    k = int((grid.reshape(-1, 3).prod(-1) // int(cfg.vision_config.spatial_merge_size) ** 2).sum())
    return is_pad & (torch.cumsum(is_pad.long(), 0) <= k)


def row_positions(model: Any, ids: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    """``[3, n]`` mrope positions of one row's ``n`` real tokens: the model's ``get_rope_index``."""
    n = int(ids.shape[0])
    if grid is None:
        return torch.arange(n, dtype=torch.long)[None].expand(3, n)
    vl = model.model
    ids = ids.cpu()
    types = row_image_tokens(ids, grid.cpu(), vl.config).int()[None]
    pos, _ = vl.get_rope_index(ids[None], mm_token_type_ids=types, image_grid_thw=grid.cpu())
    return pos[:, 0]


def _check_entry(e: dict, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(e, dict) or "pixel_values" not in e or "image_grid_thw" not in e:
        raise ValueError(f"batch['{KEY}'][{r}] must be None or a dict with pixel_values and image_grid_thw")
    return e["pixel_values"], e["image_grid_thw"]


def packed_positions(model: Any, mb: dict, lens: list[int], total: int) -> torch.Tensor:
    """``[3, 1, total]``: each row's positions after the previous rows' tokens (padding at 0)."""
    ids = mb["input_ids"].cpu()
    parts = []
    for r, (n, e) in enumerate(zip(lens, _entries(mb))):
        grid = None if e is None else _check_entry(e, r)[1]
        parts.append(row_positions(model, ids[r, :n], grid))
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    if pos.shape[1] < total:
        pos = torch.cat([pos, torch.zeros(3, total - pos.shape[1], dtype=torch.long)], dim=1)
    return pos[:, None]


def padded_positions(model: Any, mb: dict) -> torch.Tensor:
    """``[3, B, L]`` for a right-padded micro-batch (padding at 0)."""
    ids = mb["input_ids"].cpu()
    B, L = ids.shape
    lens = [int(x) for x in mb["attention_mask"].sum(dim=1).tolist()]
    pos = torch.zeros(3, B, L, dtype=torch.long)
    for r, (n, e) in enumerate(zip(lens, _entries(mb))):
        pos[:, r, :n] = row_positions(model, ids[r, :n], None if e is None else _check_entry(e, r)[1])
    return pos


def images(mb: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The micro-batch's ``pixel_values`` and ``image_grid_thw``, its rows' in row order (None: no image)."""
    pv, grids = [], []
    for r, e in enumerate(_entries(mb)):
        if e is not None:
            p, g = _check_entry(e, r)
            pv.append(p)
            grids.append(g.reshape(-1, 3))
    if not pv:
        return None
    return torch.cat(pv).float(), torch.cat(grids).long()


# ------------------------------------------------------------------ the embedding hook
class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (the tower is replicated over it, and
    each rank's features only reach its own slice of the sequence)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from areal_cli.utils import collectives

        grad = grad.contiguous().clone()
        collectives.all_reduce(grad, group=ctx.group)
        return grad, None


def _blank_image(cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes: one merged token (``merge x merge`` patches)."""
    v = cfg.vision_config
    m = int(v.spatial_merge_size)
    dim = int(v.in_channels) * int(v.temporal_patch_size) * int(v.patch_size) ** 2
    return torch.zeros(m * m, dim), torch.tensor([[1, m, m]], dtype=torch.long)


def _merge(module: Any, args: Any, out: Any) -> Any:
    pending = module.__dict__.get(_PENDING)
    if pending is None:
        return None
    visual, pv, grid, img_mask, offset, real = pending
    feats = visual(pv.to(out.device), grid_thw=grid.to(out.device)).pooler_output
    is_dt = hasattr(out, "to_local")
    local = out.to_local() if is_dt else out
    lo = offset
    if is_dt:
        from torch.distributed.tensor import Shard

        mesh = out.device_mesh
        if tuple(out.placements) != (Shard(1),):  # installed before the TP plan's own output hook
            raise RuntimeError(f"vision: the token embedding's output is {out.placements}, not sequence-sharded")
        if mesh.size() > 1:
            feats = _SumGradOverGroup.apply(feats, mesh.get_group())
            lo += mesh.get_local_rank() * local.shape[1]
    feats = feats.to(local.dtype)
    if not real:  # a blank image: no token takes it, but the tower's collectives and graph stay aligned
        local = local + feats.sum() * 0.0
    else:
        mask = img_mask.to(local.device)
        if mask.shape[0] == 1:
            before = int(mask[:, :lo].sum())
            mask = mask[:, lo:lo + local.shape[1]]
        else:
            before = 0
        n = int(mask.sum())
        local = local.masked_scatter(mask[..., None].expand_as(local), feats[before:before + n])
        if n < feats.shape[0]:  # other slices' features: in the graph (their gradient is zero here)
            local = local + feats.sum() * 0.0
    if is_dt:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, out.device_mesh, out.placements, shape=out.shape, stride=out.stride())
    return local


def install(model: Any) -> None:
    """Hook the language model's token embedding once (a no-op on a model without a tower). Call it after
    the model is parallelised: the hook must see the embedding's output as the decoder does (under archon's
    ``t``, sequence-sharded by the TP plan's own output hook, which runs first)."""
    emb = text_model(model).embed_tokens
    if tower(model) is None or emb.__dict__.get(_HOOKED):
        return
    emb.register_forward_hook(_merge)
    emb.__dict__[_HOOKED] = True


def image_token_mask(mb: dict, cfg: Any, packed_total: int | None = None) -> torch.Tensor:
    """Where the image features go: each image row's :func:`row_image_tokens` (an image token in a text row, or
    one generated after the prompt, has no picture and keeps its embedding). ``[B, L]`` for the padded batch; with ``packed_total``,
    ``[1, packed_total]`` in :func:`~areal_cli.engines.packing.pack`'s layout (the rows' real tokens in order)."""
    ids = mb["input_ids"].cpu()
    lens = [int(x) for x in mb["attention_mask"].sum(dim=1).tolist()]
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for r, (n, e) in enumerate(zip(lens, _entries(mb))):
        if e is not None:
            mask[r, :n] = row_image_tokens(ids[r, :n], _check_entry(e, r)[1], cfg)
    if packed_total is None:
        return mask
    flat = torch.cat([mask[r, :n] for r, n in enumerate(lens)]) if lens else mask.new_zeros(0)
    return torch.cat([flat, flat.new_zeros(packed_total - flat.numel())])[None]


def set_pending(model: Any, mb: dict | None, packed_total: int | None = None, offset: int = 0) -> None:
    """What the next forward's embedding hook merges: the images of ``mb`` over its image tokens, in the
    packed row of ``packed_total`` tokens (None: the padded batch), the embedding's input starting at token
    ``offset`` of that row (its Ulysses slice). ``mb`` None clears it."""
    emb = text_model(model).embed_tokens
    if mb is None or tower(model) is None:
        emb.__dict__[_PENDING] = None
        return
    cfg = model.config
    imgs = images(mb)
    real = imgs is not None
    pv, grid = imgs if real else _blank_image(cfg)
    img_mask = image_token_mask(mb, cfg, packed_total) if real else None
    if real:
        merge = int(cfg.vision_config.spatial_merge_size) ** 2
        n_feat = int((grid.prod(-1) // merge).sum())
        if int(img_mask.sum()) != n_feat:
            raise ValueError(f"batch['{KEY}']: the rows hold {int(img_mask.sum())} image tokens but their "
                             f"image_grid_thw give {n_feat} image features")
    emb.__dict__[_PENDING] = (tower(model), pv, grid, img_mask, int(offset), real)
