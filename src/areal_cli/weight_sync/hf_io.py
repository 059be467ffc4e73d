"""HF-layout model dirs, read and written one tensor at a time.

- :class:`HFCheckpoint` reads the safetensors of a model dir tensor by tensor, or a slice of one, with
  plain positioned reads (no mmap: a mapped file's touched pages count as the process's resident memory
  until it is unmapped, so reading a TP slice through mmap would grow RSS by the whole tensor). A rank
  that needs only its shard reads only its shard's bytes (a contiguous dim-0 slice) or one tensor at a time.
- :class:`HFStreamWriter` writes safetensors shards as tensors arrive (HF's sharded layout with an index,
  or one ``model.safetensors`` when everything fits one shard), holding at most one shard in memory.
- :func:`write_hf_dir` writes a whole dict through the same writer (tests, small models).

Used by every engine's HF export, by disk weight sync and by sharded model loading. The result loads
with ``AutoModelForCausalLM.from_pretrained``, the built-in ``hf`` server and vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")

# A shard is held in memory until written: 512 MiB bounds the export's peak above the training state.
MAX_SHARD_BYTES = 512 * 1024**2
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def copy_tokenizer(src: str | os.PathLike | None, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files that exist in ``src`` to ``dst``; returns the names copied."""
    if not src:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copy2(p, Path(dst) / name)
            copied.append(name)
    return copied


# ---------------------------------------------------------------------------------------------- reading
class HFCheckpoint:
    """The tensors of an HF model dir (``model*.safetensors``, with or without an index), read lazily.

    ``tied_head``: a tied model has no ``lm_head.weight``; when True it reads as the embedding.
    """

    def __init__(self, path: str | os.PathLike, *, tied_head: bool = False):
        self.path = Path(path)
        self._entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
        files = sorted(self.path.glob("model*.safetensors"))
        index = self.path / INDEX_FILE
        if index.is_file():
            names = set(json.loads(index.read_text())["weight_map"].values())
            files = [self.path / n for n in sorted(names)]
        for f in files:
            self._scan(f)
        if tied_head and "lm_head.weight" not in self._entries and "model.embed_tokens.weight" in self._entries:
            self._entries["lm_head.weight"] = self._entries["model.embed_tokens.weight"]

    def add_file(self, f: str | os.PathLike, prefix: str = "") -> None:
        """Also read the tensors of ``f`` (if it exists), under ``prefix + name`` (a critic's value head)."""
        if Path(f).is_file():
            self._scan(Path(f), prefix)

    def drop(self, prefix: str) -> None:
        """Forget the tensors named ``prefix…`` (a causal LM's own head, which a critic's value head replaces)."""
        for name in [n for n in self._entries if n.startswith(prefix)]:
            del self._entries[name]

    def _scan(self, f: Path, prefix: str = "") -> None:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        base = 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            start, end = e["data_offsets"]
            self._entries[prefix + name] = (f, e["dtype"], list(e["shape"]), base + start, base + end)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name][2])

    def nbytes(self, name: str) -> int:
        _, _, _, start, end = self._entries[name]
        return end - start

    def dtype(self, name: str):
        import torch

        return getattr(torch, _ST_DTYPES[self._entries[name][1]])

    def _read(self, f: Path, dtype, shape: list[int], offset: int, nbytes: int):
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(f, "rb", buffering=0) as fh:
            view = memoryview(buf.numpy())
            got = 0
            while got < nbytes:
                k = os.preadv(fh.fileno(), [view[got:]], offset + got)
                if k <= 0:
                    raise OSError(f"{f}: short read at {offset + got}")
                got += k
        return buf.view(dtype).reshape(shape)

    def get(self, name: str):
        """The whole tensor (a fresh CPU tensor in the file's dtype)."""
        f, _, shape, start, end = self._entries[name]
        return self._read(f, self.dtype(name), shape, start, end - start)

    def get_rows(self, name: str, start_row: int, stop_row: int):
        """Rows ``[start_row, stop_row)`` of dim 0, reading only their bytes."""
        f, _, shape, start, _ = self._entries[name]
        row = self.nbytes(name) // max(1, shape[0]) if shape else 0
        return self._read(f, self.dtype(name), [stop_row - start_row, *shape[1:]], start + start_row * row,
                          (stop_row - start_row) * row)

    def get_flat(self, name: str, lo: int, hi: int):
        """Elements ``[lo, hi)`` of the flattened tensor, reading only the dim-0 rows that hold them (a
        ZeRO-3 partition)."""
        shape = self.shape(name)
        if not shape:
            return self.get(name).reshape(-1)[lo:hi]
        row = 1
        for d in shape[1:]:
            row *= d
        hi = min(hi, row * shape[0])
        lo = min(lo, hi)
        r0, r1 = lo // row, -(-hi // row)
        return self.get_rows(name, r0, r1).reshape(-1)[lo - r0 * row:hi - r0 * row]

    def get_chunk(self, name: str, dim: int, index: int, parts: int):
        """``torch.chunk(t, parts, dim)[index]`` of the stored tensor ``t``: a dim-0 chunk reads only its
        bytes; another dim reads the tensor once and keeps the slice."""
        shape = self.shape(name)
        if parts == 1:
            return self.get(name)
        size = -(-shape[dim] // parts)
        lo, hi = min(index * size, shape[dim]), min((index + 1) * size, shape[dim])
        if dim == 0:
            return self.get_rows(name, lo, hi)
        return self.get(name).narrow(dim, lo, hi - lo).clone()


# ---------------------------------------------------------------------------------------------- writing
class HFStreamWriter:
    """Writes ``(name, tensor)`` pairs into ``path`` as safetensors shards of at most ``max_shard_bytes``.

    Shards are written under temporary names and renamed by :meth:`close`, which also writes the index
    (more than one shard) and removes model files of an earlier export in the same dir, so a reader never
    sees a mix. ``dtype`` casts floating tensors as they arrive; ``drop`` names are skipped (a tied head).
    """

    def __init__(self, path: str | os.PathLike, *, dtype: Any = None, max_shard_bytes: int = MAX_SHARD_BYTES,
                 drop: Iterable[str] = ()):
        self.out = Path(path)
        self.out.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.max_shard_bytes = int(max_shard_bytes)
        self.drop = set(drop)
        self._shard: dict[str, Any] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: Any) -> None:
        if name in self.drop:
            return
        t = tensor.detach()
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        t = t.contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        n = t.numel() * t.element_size()
        if self._shard and self._shard_bytes + n > self.max_shard_bytes:
            self._flush()
        self._shard[name] = t
        self._shard_bytes += n
        self.total_bytes += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._shard:
            return
        tmp = self.out / f".model-part{len(self._written):05d}.safetensors.tmp"
        save_file(self._shard, str(tmp), metadata={"format": "pt"})
        self._written.append((tmp, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish the dir's weights; returns the weight file names."""
        self._flush()
        for old in list(self.out.glob("model*.safetensors")) + [self.out / INDEX_FILE]:
            if old.is_file():
                old.unlink()
        if len(self._written) <= 1:
            if self._written:
                os.replace(self._written[0][0], self.out / SINGLE_FILE)
            else:  # an empty model still gets a loadable file
                from safetensors.torch import save_file

                save_file({}, str(self.out / SINGLE_FILE), metadata={"format": "pt"})
            return [SINGLE_FILE]
        n = len(self._written)
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self._written):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.out / name)
            weight_map.update({k: name for k in keys})
            names.append(name)
        idx_tmp = self.out / (INDEX_FILE + ".tmp")
        idx_tmp.write_text(json.dumps({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
                                      indent=2))
        os.replace(idx_tmp, self.out / INDEX_FILE)
        return names

    def abort(self) -> None:
        for tmp, _ in self._written:
            tmp.unlink(missing_ok=True)
        self._written, self._shard = [], {}


def write_hf_config(path: str | os.PathLike, config: Any, *, architectures: list[str] | None = None,
                    tokenizer_src: str | os.PathLike | None = None, generation_config: Any = None,
                    dtype: Any = None) -> None:
    """``config.json`` (``architectures`` set explicitly: FSDP2 renames the wrapped class, e.g.
    ``FSDPQwen2ForCausalLM``), the generation config and the tokenizer files."""
    import torch

    cfg = config.__class__.from_dict(config.to_dict())
    if architectures:
        cfg.architectures = list(architectures)
    if dtype is not None:
        cfg.dtype = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else dtype
    cfg.save_pretrained(str(path))
    if generation_config is not None:
        generation_config.save_pretrained(str(path))
    copy_tokenizer(tokenizer_src, path)


def stream_hf_dir(path: str | os.PathLike, named: Iterable[tuple[str, Any]], config: Any, *,
                  architectures: list[str] | None = None, tokenizer_src: str | os.PathLike | None = None,
                  generation_config: Any = None, dtype: Any = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write an HF dir from ``(name, tensor)`` pairs as they come (``None`` tensors are skipped: the
    pairs other ranks see while they take part in the gathers). A tied ``lm_head.weight`` is dropped, as
    transformers does."""
    drop = ("lm_head.weight",) if getattr(config, "tie_word_embeddings", False) else ()
    w = HFStreamWriter(path, dtype=dtype, max_shard_bytes=max_shard_bytes, drop=drop)
    try:
        for name, t in named:
            if t is not None:
                w.add(name, t)
        w.close()
    except BaseException:
        w.abort()
        raise
    write_hf_config(path, config, architectures=architectures, tokenizer_src=tokenizer_src,
                    generation_config=generation_config, dtype=dtype)
    return str(path)


def write_hf_dir(path: str | os.PathLike, tensors: dict[str, Any], config: Any, *,
                 architectures: list[str] | None = None, tokenizer_src: str | os.PathLike | None = None,
                 generation_config: Any = None, dtype: Any = None) -> str:
    """Write ``tensors`` (full, CPU) next to ``config.json``: :func:`stream_hf_dir` over a dict."""
    return stream_hf_dir(path, tensors.items(), config, architectures=architectures, tokenizer_src=tokenizer_src,
                         generation_config=generation_config, dtype=dtype)
