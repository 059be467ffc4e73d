"""Micro-batch splitting and padding-free packing for the training engines.

Batches follow the layout in :mod:`areal_cli.api.engine_api`: dicts of right-padded ``[B, L]``
tensors (plus optional per-sequence ``[B]`` tensors and per-row lists of length ``B``, such as each row's
images under ``multi_modal``: row selection keeps them with their rows). Three steps turn one into model
inputs:

1. :func:`ffd_bins` groups sequences by a token budget with first-fit-decreasing.
2. :func:`equalize_bins` splits bins until every data-parallel rank has the same number of
   micro-batches (collectives in FSDP need every rank to run the same number of forwards).
3. :func:`pack` concatenates the sequences of one micro-batch into a single ``[1, T]`` row with
   per-sequence ``position_ids``; :func:`unpack` scatters per-token outputs back to ``[b, l]``.

Pure torch, no torch.distributed: the engine does the one all-reduce that :func:`equalize_bins`
needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


def seq_lens(batch: dict) -> list[int]:
    """Number of real tokens per row (``attention_mask`` sum)."""
    return [int(x) for x in batch["attention_mask"].sum(dim=1).tolist()]


def ffd_bins(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing: indices grouped into bins of at most ``max_tokens`` tokens.

    A sequence longer than ``max_tokens`` gets a bin of its own (it cannot be split). Indices within
    a bin are sorted ascending and bins are ordered by their first index, so the result is a pure
    function of the lengths (deterministic across ranks and runs).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def equalize_bins(bins: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """Split the heaviest multi-sequence bins until there are ``target`` bins.

    Returns fewer than ``target`` bins only when every bin already holds one sequence; the engine
    pads the rest with empty (zero-weight) micro-batches.
    """
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda b: (sum(lengths[i] for i in b), -b[0]))
        bins.remove(heaviest)
        # Halve by tokens: greedily give the longest sequences alternately to two halves.
        left: list[int] = []
        right: list[int] = []
        lt = rt = 0
        for i in sorted(heaviest, key=lambda i: (-lengths[i], i)):
            if lt <= rt:
                left.append(i)
                lt += lengths[i]
            else:
                right.append(i)
                rt += lengths[i]
        bins.extend([sorted(left), sorted(right)])
        bins.sort(key=lambda b: b[0])
    return bins


def select_rows(batch: dict, idx: list[int]) -> dict:
    """Rows ``idx`` of every ``[B, ...]`` tensor, trimmed to the longest selected sequence."""
    import torch

    B = batch["input_ids"].shape[0]
    index = torch.tensor(idx, dtype=torch.long)
    lens = batch["attention_mask"][index].sum(dim=1)
    max_len = int(lens.max().item()) if len(idx) else 0
    out = {}
    for k, v in batch.items():
        if isinstance(v, list) and len(v) == B:  # per-row objects (``multi_modal``: each row's images)
            out[k] = [v[i] for i in idx]
            continue
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != B:
            out[k] = v
            continue
        sel = v.index_select(0, index.to(v.device))
        if sel.dim() >= 2 and sel.shape[1] == batch["input_ids"].shape[1]:
            sel = sel[:, :max_len]
        out[k] = sel
    return out


def split_batch_for_dp(batch: dict, dp_size: int) -> list[dict]:
    """Split a global batch into ``dp_size`` row groups with balanced token counts.

    Uses the longest-first greedy assignment (each sequence goes to the lightest rank), keeping
    row order within a rank. Every rank gets at least one row when ``B >= dp_size``.
    """
    lens = seq_lens(batch)
    if len(lens) < dp_size:
        raise ValueError(f"batch of {len(lens)} rows cannot be split over {dp_size} data-parallel ranks")
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        r = min(range(dp_size), key=lambda r: (loads[r], len(groups[r]), r))
        groups[r].append(i)
        loads[r] += lens[i]
    return [select_rows(batch, sorted(g)) for g in groups]


@dataclass
class Packed:
    """One micro-batch packed into a single row.

    ``input_ids``/``position_ids``/``seq_ids`` are ``[1, T]`` (``T`` padded up to ``pad_to``);
    padding tokens get their own sequence id so they only attend to themselves. ``lengths`` are
    the real token counts of the packed rows, in order.
    """

    input_ids: "torch.Tensor"
    position_ids: "torch.Tensor"
    seq_ids: "torch.Tensor"
    lengths: list[int]
    n_real: int


def pack(mb: dict, pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> Packed:
    """Concatenate the real tokens of each row of ``mb`` into one row."""
    import torch

    lens = seq_lens(mb)
    src = mb["input_ids"]
    # one gather and (for a device micro-batch) one host copy, not a copy per row
    flat = src.reshape(-1).index_select(0, row_prefix_index(lens, src.shape[1], src.device)).cpu()
    pos = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.long)
    sid = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(lens)]) if lens else pos
    n_real = flat.numel()
    m = max(1, pad_to_multiple_of)
    total = max(m, -(-n_real // m) * m)
    n_pad = total - n_real
    if n_pad:
        flat = torch.cat([flat, torch.full((n_pad,), pad_token_id, dtype=flat.dtype)])
        pos = torch.cat([pos, torch.zeros(n_pad, dtype=torch.long)])
        sid = torch.cat([sid, len(lens) + torch.arange(n_pad)])
    return Packed(flat[None], pos[None], sid[None], lens, n_real)


def row_prefix_index(lengths: list[int], width: int, device: "torch.device | None" = None) -> "torch.Tensor":
    """Flat indices of each row's first ``lengths[r]`` entries in a row-major ``[len(lengths), width]``
    tensor (built on the host, where the lengths are, then moved to ``device``)."""
    import torch

    if not lengths:
        return torch.zeros(0, dtype=torch.long, device=device)
    n = torch.tensor(lengths, dtype=torch.long)
    starts = torch.arange(len(lengths), dtype=torch.long) * width
    offsets = torch.cumsum(n, 0) - n
    idx = torch.arange(int(n.sum()), dtype=torch.long) - torch.repeat_interleave(offsets - starts, n)
    return idx.to(device) if device is not None else idx


def packed_causal_mask(seq_ids: "torch.Tensor") -> "torch.Tensor":
    """Block-diagonal causal boolean mask ``[1, 1, T, T]`` (True = may attend)."""
    import torch

    s = seq_ids[0]
    T = s.numel()
    causal = torch.ones(T, T, dtype=torch.bool, device=s.device).tril()
    return (causal & (s[:, None] == s[None, :]))[None, None]


def padded_causal_mask(attention_mask: "torch.Tensor") -> "torch.Tensor":
    """Causal mask ``[B, 1, L, L]`` that also hides right-padding keys."""
    import torch

    B, L = attention_mask.shape
    causal = torch.ones(L, L, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    mask = causal[None, None] & keys
    # A padded query row must still see itself, or softmax over an empty set gives NaN.
    eye = torch.eye(L, dtype=torch.bool, device=attention_mask.device)[None, None]
    return mask | eye


def next_token_targets(packed: Packed) -> "torch.Tensor":
    """``[T]`` target ids: position ``t`` predicts token ``t+1`` of the same sequence (else 0)."""
    import torch

    ids = packed.input_ids[0]
    sid = packed.seq_ids[0]
    tgt = torch.zeros_like(ids)
    if ids.numel() > 1:
        same = sid[1:] == sid[:-1]
        tgt[:-1] = torch.where(same, ids[1:], torch.zeros_like(ids[1:]))
    return tgt


def loss_positions(mb: dict, packed: Packed) -> "torch.Tensor":
    """Packed positions whose *next* token is a loss token (``loss_mask`` > 0): the only positions
    whose logits a loss reads. Row ``r``'s token ``i`` sits at ``start_r + i``, predicted at ``- 1``."""
    import torch

    mask = mb["loss_mask"]
    lens = packed.lengths
    if not lens:
        return torch.zeros(0, dtype=torch.long, device=mask.device)
    # Packed position p = start_r + i - 1 predicts row r's token i (1 <= i < n_r): one nonzero over the
    # gathered flags instead of one per row (each is a host sync for a device mask).
    flags = torch.zeros(len(lens), mask.shape[1], dtype=torch.bool, device=mask.device)
    flags[:, :-1] = mask[:, 1:] > 0
    flags &= torch.arange(mask.shape[1], device=mask.device)[None] < torch.tensor(
        [max(0, n - 1) for n in lens], device=mask.device)[:, None]
    pos = row_prefix_index(lens, mask.shape[1], mask.device)
    return flags.reshape(-1).index_select(0, pos).nonzero().squeeze(1)


def unpack_shifted(values: "torch.Tensor", packed: Packed, max_len: int) -> "torch.Tensor":
    """Map per-position "predicts next token" values ``[T]`` to the engine's position convention.

    Output ``[b, max_len]``: entry ``i`` of row ``r`` is ``values`` at the packed position of token
    ``i-1`` (so it concerns token ``i``); entry 0 and padding are 0. Differentiable.
    """
    import torch

    rows = []
    off = 0
    for n in packed.lengths:
        row = values.new_zeros(max_len)
        if n > 1:
            row = torch.cat([values.new_zeros(1), values[off:off + n - 1], values.new_zeros(max_len - n)])
        rows.append(row)
        off += n
    return torch.stack(rows) if rows else values.new_zeros(0, max_len)


def shift_padded(values: "torch.Tensor") -> "torch.Tensor":
    """``[b, l]`` "predicts next" values → position convention (entry i concerns token i)."""
    import torch

    return torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)


# ---------------------------------------------------------------------------------------------------
# Shared-prefix packing: the samples of a GRPO group share their prompt, so the prompt runs once.
#
# Causal attention makes a prompt's hidden states independent of what follows it, so computing them
# once and letting every completion of the group attend to the same keys/values gives the same
# outputs, and (autograd summing over the uses) the same gradients, as one copy per sample.


def first_loss_index(mb: dict) -> list[int]:
    """Per row: the first token index ``i >= 1`` with ``loss_mask > 0`` (the row's length if none).
    Tokens before it are the row's prefix: read, never trained on."""
    import torch

    lens = mb["attention_mask"].sum(dim=1)
    m = mb["loss_mask"][:, 1:] > 0
    m &= torch.arange(1, m.shape[1] + 1, device=m.device)[None] < lens[:, None]
    first = torch.where(m.any(dim=1), m.int().argmax(dim=1) + 1, lens)
    return [int(x) for x in first.tolist()]


def prefix_groups(mb: dict, lens: list[int] | None = None, first: list[int] | None = None) -> list[list[int]]:
    """Rows grouped by identical prefix (token ids before the first loss token), in first-row order.
    A row without loss tokens is a group of its own. ``lens``/``first``: already computed
    :func:`seq_lens` / :func:`first_loss_index` of ``mb``."""
    lens = seq_lens(mb) if lens is None else lens
    first = first_loss_index(mb) if first is None else first
    ids = mb["input_ids"]
    groups: dict[tuple, list[int]] = {}
    for r, (n, f) in enumerate(zip(lens, first)):
        key = ("row", r) if f >= n else tuple(ids[r, :f].tolist())
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def shared_cost(lens: list[int], first: list[int], rows: list[int]) -> int:
    """Tokens a forward over ``rows`` packed with one shared prefix costs."""
    return first[rows[0]] + sum(lens[r] - first[r] for r in rows)


def prefix_bins(batch: dict, max_tokens: int) -> list[list[int]]:
    """:func:`ffd_bins` over prefix groups instead of rows, costed at their shared token count, so
    the rows of a group land in the same micro-batch. A group over budget is cut into chunks."""
    lens = seq_lens(batch)
    first = first_loss_index(batch)
    units: list[list[int]] = []
    for g in prefix_groups(batch, lens, first):
        chunk: list[int] = []
        for r in g:
            if chunk and shared_cost(lens, first, chunk + [r]) > max_tokens:
                units.append(chunk)
                chunk = []
            chunk.append(r)
        units.append(chunk)
    unit_bins = ffd_bins([shared_cost(lens, first, u) for u in units], max_tokens)
    bins = [sorted(r for u in b for r in units[u]) for b in unit_bins]
    return sorted(bins, key=lambda b: b[0])


@dataclass
class SharedPack:
    """A micro-batch packed as one row of *group sequences*: each is a prefix followed by the
    suffixes (tokens from the first loss token on) of every row sharing it.

    ``seg_lens`` are the group sequences' lengths and ``seg_ids`` ``[T]`` mark the prefix (0) and
    the k-th suffix (k) within each. Outputs are read at ``keep`` positions (unique, ascending);
    entry ``e`` of the flat outputs is token ``cols[e]`` of row ``rows[e]``, predicted at
    ``keep[map[e]]`` with target ``targets[e]``.
    """

    input_ids: "torch.Tensor"
    position_ids: "torch.Tensor"
    seg_lens: list[int]
    seg_ids: "torch.Tensor"
    keep: "torch.Tensor"
    map: "torch.Tensor"
    targets: "torch.Tensor"
    rows: "torch.Tensor"
    cols: "torch.Tensor"


def pack_shared(mb: dict, loss_only: bool = True) -> SharedPack | None:
    """Pack ``mb`` with shared prefixes; ``None`` when no two rows share one (use :func:`pack`).

    ``loss_only``: outputs only for loss tokens (else for every token ``i >= 1`` of every row).
    Built with Python lists and one tensor per field: a rollout batch is many short rows.
    """
    import torch

    lens = seq_lens(mb)
    first = first_loss_index(mb)
    groups = prefix_groups(mb, lens, first)
    if all(len(g) == 1 for g in groups):
        return None
    ids_all = mb["input_ids"].tolist()
    loss = (mb["loss_mask"] > 0).tolist()
    ids: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    seg_lens: list[int] = []
    pred: list[int] = []
    tgt: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    for g in groups:
        start, r0 = len(ids), g[0]
        f = min(first[r0], lens[r0])
        ids += ids_all[r0][:f]
        pos += range(f)
        seg += [0] * f
        # Tokens of the prefix itself (full outputs only): identical in every row, computed once.
        want = [i for i in range(1, f) if not loss_only or loss[r0][i]]
        for r in g if want else []:
            pred += [start + i - 1 for i in want]
            tgt += [ids_all[r][i] for i in want]
            rows += [r] * len(want)
            cols += want
        for k, r in enumerate(g, start=1):
            n, off = lens[r], len(ids)
            ids += ids_all[r][f:n]
            pos += range(f, n)
            seg += [k] * (n - f)
            want = [i for i in range(f, n) if not loss_only or loss[r][i]]
            # Token i is predicted at the previous token: the prefix's last one for i = f.
            pred += [off + i - f - 1 if i > f else start + f - 1 for i in want]
            tgt += [ids_all[r][i] for i in want]
            rows += [r] * len(want)
            cols += want
        seg_lens.append(len(ids) - start)

    def t(x: list[int]) -> "torch.Tensor":
        return torch.tensor(x, dtype=torch.long)

    keep, inv = torch.unique(t(pred), sorted=True, return_inverse=True)
    return SharedPack(t(ids)[None], t(pos)[None], seg_lens, t(seg), keep, inv, t(tgt), t(rows), t(cols))
