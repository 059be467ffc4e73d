"""SGLang's own HTTP routes, request models and weight receiver, on a CPU host without SGLang's runtime.

Run as a process: ``python tests/support/sglang_harness.py --port P --tp 2``. It serves
SGLang's real FastAPI ``app`` (``sglang.srt.entrypoints.http_server``): every request is parsed and
validated by SGLang's own route and request model exactly as on a real server. Behind the routes,
a stand-in for SGLang's tokenizer manager applies SGLang's own checks (``GenerateReqInput``
normalisation, ``SamplingParams`` construction / ``normalize`` / ``verify``), requires the
begin/end weight-update session the real scheduler requires, and drives ``tp`` rank processes that
each hold SGLang's own ``WeightUpdater``: ``init_weights_update_group`` (SGLang's
``init_custom_process_group`` at ``rank_offset + tp_rank``) and ``receive_weights_from_distributed``
(per-tensor or ``flattened_bucket``). The ranks of one server share a default gloo group, as SGLang's
TP workers do (its updater requires one).

Extra routes for the tests: ``GET /_contract`` (every request body received, by route, with the
request model's class and field names; ``POST /_forget`` clears it), ``GET /_received`` (what each
rank received), ``GET /_state``.

SGLang is imported from the directory ``scripts/setup_sglang_contract.sh`` fills (``$AREAL_SGLANG_PATH``,
default ``.venv-sglang/site``). Two packages SGLang imports are not installed: triton (1 GB, GPU
compiler) is stubbed with SGLang's own ``_platform_stubs`` (what SGLang does on macOS), and
torchvision (its PyPI build links CUDA) with an empty module that transformers is told is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing as mp
import os
import platform
import signal
import sys
import types
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.23"


def sglang_path() -> Path:
    return Path(os.environ.get("AREAL_SGLANG_PATH") or REPO / ".venv-sglang" / "site")


def available() -> bool:
    return (sglang_path() / "sglang" / "srt" / "managers" / "io_struct.py").exists()


class _AbsentModules:
    """Import hook: ``import torchvision...`` yields SGLang's catch-all mock module (imports only;
    nothing here calls into it)."""

    def __init__(self, stubs: types.ModuleType, names: set[str]):
        self.stubs, self.names = stubs, names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self.names:
            return None
        mod = self.stubs._MockModule(fullname)
        sys.modules[fullname] = mod
        parent, _, child = fullname.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
        return mod.__spec__


def bootstrap() -> None:
    """Make ``import sglang`` work in this (CPU, torch 2.13.0+cpu) process."""
    import torch

    sys.path.insert(0, str(sglang_path()))
    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs",
                                                  sglang_path() / "sglang" / "_platform_stubs.py")
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    if importlib.util.find_spec("triton") is None:
        # SGLang installs its triton stub only on Apple MPS hosts; let it believe it is on one,
        # then undo the MPS-only tensor patches it adds alongside.
        to, copy_ = torch.Tensor.to, torch.Tensor.copy_
        with mock.patch.object(sys, "platform", "darwin"), \
                mock.patch.object(platform, "machine", return_value="arm64"), \
                mock.patch.object(torch.backends.mps, "is_available", return_value=True):
            stubs.install_platform_stubs()
        torch.Tensor.to, torch.Tensor.copy_ = to, copy_
    absent = {"torchvision"} if importlib.util.find_spec("torchvision") is None else set()
    if absent:
        sys.meta_path.insert(0, _AbsentModules(stubs, absent))
        import transformers.utils.import_utils as iu

        real = iu._is_package_available
        iu._is_package_available = lambda name, return_version=False: (
            (False, "N/A" if return_version else None) if name in absent else real(name, return_version))
        for f in ("is_torchvision_available", "is_torchvision_v2_available"):
            getattr(iu, f).cache_clear()
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"expected sglang {SGLANG_VERSION} in {sglang_path()}, found {sglang.__version__}")


# ---------------------------------------------------------------------------------------- TP ranks
def _rank_main(conn, tp_rank: int, tp: int, tp_port: int) -> None:
    """One TP rank of a simulated server: SGLang's ``WeightUpdater`` driven over a pipe."""
    from areal_cli.utils.procs import die_with_parent

    arm = die_with_parent(signal.SIGKILL, parent=os.getppid())  # no orphan if the server is killed
    if arm is not None:
        arm()
    bootstrap()
    import torch
    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=tp)
    wu = WeightUpdater(tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                       get_model=lambda: None, update_model_fields=lambda *a, **k: None,
                       recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    received: dict[str, torch.Tensor] = {}
    while True:
        op, kw = conn.recv()
        try:
            if op == "init":
                conn.send(wu.init_weights_update_group(**kw))
            elif op == "recv":
                for name, t in wu.receive_weights_from_distributed(**kw):
                    received[name] = t.clone()
                conn.send((True, f"received {len(kw['names'])}"))
            elif op == "dump":
                conn.send({n: (str(t.dtype).replace("torch.", ""), t.float().tolist()) for n, t in received.items()})
            elif op == "stop":
                conn.send(None)
                return
        except Exception as e:  # reported to the HTTP side as SGLang reports it: success=false
            conn.send((False, f"{type(e).__name__}: {e}"))


# ---------------------------------------------------------------------------------------- server
class FakeTokenizerManager:
    """What SGLang's routes call, with SGLang's own request checks; weights go to the TP ranks."""

    def __init__(self, ranks: list, vocab_size: int, model_path: str):
        from sglang.srt.managers.tokenizer_manager import ServerStatus
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.ranks = ranks
        self.vocab_size = vocab_size
        self.model_path = self.served_model_name = model_path
        self.sampling_params_class = SamplingParams
        # What SamplingParams.normalize reads of a tokenizer (stop strings, eos for min_new_tokens).
        self.tokenizer = types.SimpleNamespace(eos_token_id=0, encode=lambda s, add_special_tokens=False: list(
            s.encode()))
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.model_config = types.SimpleNamespace(
            is_image_understandable_model=False, is_audio_understandable_model=False, vocab_size=vocab_size,
            hf_config=types.SimpleNamespace(model_type="qwen2", architectures=["Qwen2ForCausalLM"]))
        self.weight_version = "default"
        self.paused = False
        self.session = False
        self.memory_released = False
        self.loras: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self._rank_lock = asyncio.Lock()

    server_args = None
    startup_time = 0.0

    async def get_internal_state(self):
        return [{}]

    def config_value(self, key: str):
        return {"weight_version": self.weight_version, "load_format": "auto"}.get(key)

    async def _ranks(self, op: str, kw: dict) -> list:
        def run():
            for c in self.ranks:
                c.send((op, kw))
            return [c.recv() for c in self.ranks]

        async with self._rank_lock:
            return await asyncio.to_thread(run)

    async def generate_request(self, obj, request=None):
        obj.normalize_batch_and_arguments()  # SGLang's own normalisation (raises ValueError on bad input)
        for name in ([obj.lora_path] if isinstance(obj.lora_path, str) else obj.lora_path or []):
            if name is not None and name not in self.loras:  # what _resolve_lora_path refuses
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}")
        batch = not obj.is_single
        ids = obj.input_ids if batch else [obj.input_ids]
        sps = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * len(ids)
        outs = []
        # SGLang's normalised image_data: per prompt in a batch, as sent for one prompt (tests read it back)
        images = obj.image_data if batch else [obj.image_data]
        for prompt, sp, img in zip(ids, sps, images):
            params = self.sampling_params_class(**(sp or {}))  # TypeError on an unknown key
            params.normalize(self.tokenizer)
            params.verify(self.vocab_size)
            n = min(params.max_new_tokens or 1, 3)
            toks = [(prompt[-1] + 1 + i) % self.vocab_size for i in range(n)]
            outs.append({"text": "", "output_ids": toks, "meta_info": {
                "id": "x", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(prompt),
                "completion_tokens": n, "cached_tokens": 0, "weight_version": self.weight_version,
                "output_token_logprobs": [[-0.5, t, None] for t in toks]}})
            if img is not None:
                outs[-1]["meta_info"]["harness_image_data"] = img
        yield outs if batch else outs[0]

    def create_abort_task(self, obj):
        return None

    async def pause_generation(self, obj):
        self.paused = True

    async def continue_generation(self, obj):
        self.paused = False

    async def begin_weight_update(self, obj, request=None):
        if self.session:  # SGLang's scheduler: one session at a time
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "weight update session opened"

    async def end_weight_update(self, obj, request=None):
        if not self.session:
            return False, "no weight update session is open"
        self.session = False
        return True, "weight update session closed"

    async def init_weights_update_group(self, obj, request=None):
        kw = dict(master_address=obj.master_address, master_port=obj.master_port, rank_offset=obj.rank_offset,
                  world_size=obj.world_size, group_name=obj.group_name, backend=obj.backend)
        res = await self._ranks("init", kw)
        bad = [m for ok, m in res if not ok]
        return (False, "; ".join(bad)) if bad else (True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, obj, request=None):
        if not self.session:  # what SGLang's scheduler answers without /begin_weight_update
            return False, "update_weights_from_distributed requires an open weight update session " \
                          "(POST /begin_weight_update first)"
        kw = dict(names=obj.names, dtypes=obj.dtypes, shapes=obj.shapes, group_name=obj.group_name,
                  load_format=obj.load_format)
        res = await self._ranks("recv", kw)
        bad = [m for ok, m in res if not ok]
        if bad:
            return False, "; ".join(bad)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update parameter online."

    async def update_weights_from_disk(self, obj, request=None):
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update model weights.", 0

    async def update_weight_version(self, obj):
        self.weight_version = obj.new_version

    async def load_lora_adapter(self, obj, request=None):
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        if obj.lora_name in self.loras:  # LoRARegistry.register refuses a loaded name
            return LoRAUpdateOutput(success=False,
                                    error_message=f"LoRA adapter {obj.lora_name} already exists")
        self.loras[obj.lora_name] = obj.lora_path
        return LoRAUpdateOutput(success=True, loaded_adapters=dict(self.loras))

    async def unload_lora_adapter(self, obj, request=None):
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        if self.loras.pop(obj.lora_name, None) is None:
            return LoRAUpdateOutput(success=False,
                                    error_message=f"LoRA adapter {obj.lora_name} is not loaded")
        return LoRAUpdateOutput(success=True, loaded_adapters=dict(self.loras))

    async def release_memory_occupation(self, obj, request=None):
        self.memory_released = True

    async def resume_memory_occupation(self, obj, request=None):
        self.memory_released = False


def _route_models(app) -> dict[str, type]:
    """Request model of every SGLang route that takes a JSON body, from the route itself."""
    import inspect
    import typing

    out = {}
    for route in app.routes:
        ep = getattr(route, "endpoint", None)
        if ep is None:
            continue
        try:
            hints = typing.get_type_hints(ep, include_extras=True)
        except Exception:
            continue
        for name in inspect.signature(ep).parameters:
            t = hints.get(name)
            if typing.get_origin(t) is typing.Annotated:
                t = typing.get_args(t)[0]
            if isinstance(t, type) and t.__module__.startswith("sglang.srt.managers.io_struct"):
                out[route.path] = t
    return out


def _fields(model: type) -> list[str]:
    import dataclasses

    import msgspec

    if dataclasses.is_dataclass(model):
        return [f.name for f in dataclasses.fields(model)]
    return [f.name for f in msgspec.structs.fields(model)]


def serve(port: int, tp: int, tp_port: int, vocab_size: int) -> None:
    # What launch.py sets for SGLang servers: /health answers without generating a token.
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    bootstrap()
    import json

    import uvicorn
    from sglang.srt.entrypoints import http_server as hs

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for r in range(tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, args=(child, r, tp, tp_port), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    tm = FakeTokenizerManager(conns, vocab_size, "/models/tiny")
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    # /model_info reads the published server args; publish only what it reads.
    hs.get_serving = lambda: types.SimpleNamespace(tokenizer_path="/models/tiny", preferred_sampling_params=None,
                                                   api_key=None, admin_api_key=None)
    # /server_info reports the launch configuration (there is none here) next to the version.
    hs.build_server_info = lambda server_args, scheduler_info: {}
    models = _route_models(hs.app)
    seen: dict[str, list] = {}

    async def recording(scope, receive, send):
        """Plain ASGI wrapper: keeps each JSON body, then replays it to SGLang's app."""
        if scope["type"] != "http":
            return await hs.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        if body:
            try:
                seen.setdefault(scope["path"], []).append(json.loads(body))
            except ValueError:
                pass
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await hs.app(scope, replay, send)

    @hs.app.get("/_contract")
    async def contract():
        return {path: {"model": models[path].__name__ if path in models else None,
                       "fields": _fields(models[path]) if path in models else None,
                       "bodies": bodies} for path, bodies in seen.items()}

    @hs.app.post("/_forget")
    async def forget():
        seen.clear()
        return {}

    @hs.app.get("/_received")
    async def received():
        return await tm._ranks("dump", {})

    @hs.app.get("/_state")
    async def state():
        return {"paused": tm.paused, "session": tm.session, "weight_version": tm.weight_version,
                "memory_released": tm.memory_released, "loras": tm.loras}

    print(f"sglang harness: sglang {SGLANG_VERSION}, {len(models)} routes with request models", flush=True)
    uvicorn.run(recording, host="127.0.0.1", port=port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tp-port", type=int, required=True)
    ap.add_argument("--vocab-size", type=int, default=256)
    a = ap.parse_args()
    serve(a.port, a.tp, a.tp_port, a.vocab_size)
