"""The ``hf`` server's LoRA routes (SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``, plus the
hf-only ``/load_lora_adapter_from_distributed``); the adapter logic is in :mod:`.lora`.

hf extensions of SGLang's load request (SGLang ignores unknown keys; the client sends them to hf only):
``replace: true`` swaps an adapter already loaded under ``lora_name`` at one token boundary (running
requests keep going on the new adapter: no gap in which the name is unknown), and ``weight_version``
sets the server's version in the same step, as the full-weight updates do.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areal_cli.inference.server import lora as L
from areal_cli.inference.server import weights as W
from areal_cli.inference.server.schema import BadRequest, bucket_request, group_problem

PATHS = {"/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_distributed"}


def _ok(listing: dict[str, str], **extra: Any) -> dict:
    return {"success": True, "error_message": None, "loaded_adapters": listing, **extra}


def fail(status: int, message: str) -> JSONResponse:
    """SGLang's ``LoRAUpdateOutput`` shape, plus the ``error`` object the other hf routes answer with."""
    return JSONResponse({"success": False, "error_message": message, "loaded_adapters": None,
                         "message": message,
                         "error": {"message": message, "code": status}}, status_code=status)


def register(app: FastAPI, state: Any, read_json: Callable, h: Any) -> None:
    eng = state.engine

    def flags(body: dict) -> tuple[bool, int | None]:
        replace = body.get("replace", False)
        if not isinstance(replace, bool):
            raise BadRequest("replace (bool) must be true or false")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise BadRequest("pinned (bool) must be true or false")
        return replace, h.parse_version(body)

    async def install(adapter: L.Adapter, replace: bool, version: int | None) -> dict:
        def swap() -> dict[str, str]:
            if replace and adapter.name in eng.adapters.by_name:
                eng.adapters.by_name[adapter.name] = adapter  # running rows pick it up at this boundary
                out = eng.adapters.listing()
            else:
                out = eng.load_adapter(adapter)
            h.set_version(version)
            return out

        listing = await asyncio.wrap_future(eng.call(swap))
        return _ok(listing, weight_version=str(eng.version))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await read_json(request)
        path = body.get("lora_path")
        try:
            name = L.check_name(body.get("lora_name"))
        except L.AdapterRejected as e:
            return fail(400, str(e))
        if not isinstance(path, str) or not path:
            return fail(400, "lora_path (a peft adapter directory) is required")
        replace, version = flags(body)
        async with state.weight_lock:
            if name in eng.adapters.by_name and not replace:
                return fail(400, f"LoRA adapter {name!r} is already loaded; unload it first")
            try:
                cfg, tensors = await asyncio.to_thread(L.read_adapter_dir, path, state.allowed_roots)
                adapter = await asyncio.to_thread(L.build_adapter, eng.model, name, path, cfg, tensors,
                                                  eng.adapters.max_rank)
            except PermissionError as e:
                return fail(403, str(e))
            except FileNotFoundError as e:
                return fail(404, str(e))
            except L.AdapterRejected as e:
                return fail(400, f"rejected LoRA adapter {name!r} (nothing loaded): {e}")
            try:
                return await install(adapter, replace, version)
            except L.AdapterRejected as e:
                return fail(400, str(e))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await read_json(request)
        try:
            name = L.check_name(body.get("lora_name"))
        except L.AdapterRejected as e:
            return fail(400, str(e))
        async with state.weight_lock:
            try:
                listing = await asyncio.wrap_future(eng.call(lambda: eng.unload_adapter(name)))
            except L.AdapterRejected as e:
                return fail(400, str(e))
        return _ok(listing)

    @app.post("/load_lora_adapter_from_distributed")
    async def load_from_distributed(request: Request):
        body = await read_json(request)
        names, dtypes, shapes, flattened = bucket_request(body)
        replace, version = flags(body)
        rec = state.receiver
        if (why := group_problem(rec, body)) is not None:
            return fail(400, why)
        problem = None
        try:
            name = L.check_name(body.get("lora_name"))
            L.config_rank_alpha(body.get("config_dict"))
            if name in eng.adapters.by_name and not replace:
                problem = f"LoRA adapter {name!r} is already loaded; unload it first"
        except L.AdapterRejected as e:
            problem = str(e)
        layout_ok = len(names) == len(dtypes) == len(shapes) and all(isinstance(s, list) for s in shapes)
        if layout_ok:
            try:
                (W.flat_layout if flattened else W.bucket_layout)(dtypes, shapes)
            except (W.WeightUpdateRejected, TypeError, ValueError) as e:
                problem, layout_ok = problem or str(e), False
        else:
            problem = problem or "names/dtypes/shapes must be lists of equal length (shapes lists of ints)"
        async with state.weight_lock:
            if problem is not None:
                if layout_ok:  # keep the collective in step with the trainer, then reject
                    try:
                        await asyncio.to_thread(rec.drain, names, dtypes, shapes, flattened)
                    except Exception:
                        pass
                return fail(400, f"rejected LoRA adapter (nothing loaded): {problem}")
            def receive_and_build():  # one thread hop: the push's latency is mostly fixed costs
                try:
                    tensors = rec.receive(names, dtypes, shapes, flattened)
                except Exception as e:
                    raise W.ReceiveFailed(str(e)) from e
                return L.build_adapter(eng.model, name, "<distributed>", body["config_dict"], tensors,
                                       eng.adapters.max_rank)

            try:
                adapter = await asyncio.to_thread(receive_and_build)
                return await install(adapter, replace, version)
            except W.ReceiveFailed as e:
                return fail(500, f"broadcast receive failed in group {rec.group_name}: {e}")
            except L.AdapterRejected as e:
                return fail(400, f"rejected LoRA adapter {name!r} (nothing loaded): {e}")
