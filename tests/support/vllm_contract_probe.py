"""Run by tests/integration/inference/test_vllm_contract.py in the vllm venv: the project's vLLM argv, environment
and HTTP calls checked by vLLM's own code (no engine, no model forward).

Input: a JSON file (argv[1]) with ``env`` (the launcher's variables), ``argvs`` ({label: server argv after
``-m vllm.entrypoints.openai.api_server``}), ``engine_argv`` (the label whose engine config is built),
``ranks`` (LoRA ranks for vLLM's ``LoRAConfig``) and ``calls`` ({label: {method, path, params, json}}).
Output (stdout, last line): JSON with, per argv, whether vLLM's serve parser and
``validate_parsed_serve_args`` accept it; the engine config built from one of them; per rank, whether
``LoRAConfig`` accepts it; and per call what vLLM's app (built by ``build_app`` with those args and that
environment) does with it: the matching route, the body fields its request model does not know (vLLM
ignores or only logs them, so a renamed field would pass silently), the status of the request sent
through the app, whether the route's own validation refused it (``refused``: the errors FastAPI raised
from vLLM's request model; otherwise the handler ran and failed only for want of an engine) and the
nested payload checks (weight-transfer dataclasses, ``collective_rpc`` method signature).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import sys


def _parse(argv: list[str]):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
            validate_parsed_serve_args(args)
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1:] or ["argparse exit"]
    except Exception as e:  # vLLM's own validation
        return None, [f"{type(e).__name__}: {e}"]
    return args, None


def _engine_config(args) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    try:
        cfg = EngineArgs.from_cli_args(args).create_engine_config()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    lora = cfg.lora_config
    return {"logprobs_mode": str(cfg.model_config.logprobs_mode), "dtype": str(cfg.model_config.dtype),
            "max_model_len": cfg.model_config.max_model_len, "seed": cfg.model_config.seed,
            "max_lora_rank": lora.max_lora_rank if lora is not None else None}


def _route(app, method: str, path: str):
    for r in app.routes:
        if getattr(r, "path", None) == path and method in (getattr(r, "methods", None) or ()):
            return r
    return None


def _unknown_fields(route, body) -> list[str]:
    from pydantic import BaseModel

    field = getattr(route, "body_field", None)
    model = field.field_info.annotation if field is not None else None
    if not (isinstance(body, dict) and inspect.isclass(model) and issubclass(model, BaseModel)):
        return []
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    return sorted(set(body) - known)


def _nested(path: str, body) -> str | None:
    """vLLM's own parsing of what its handlers pass on without validating (None = accepted)."""
    try:
        if path == "/init_weight_transfer_engine":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            object.__new__(NCCLWeightTransferEngine).parse_init_info(body["init_info"])
        elif path == "/update_weights":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            object.__new__(NCCLWeightTransferEngine).parse_update_info(body["update_info"])
        elif path == "/inference/v1/generate":  # its handler reads the body itself; SamplingParams is a struct
            from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
            from vllm.sampling_params import SamplingParams

            GenerateRequest.model_validate(body)
            unknown = sorted(set(body.get("sampling_params") or {}) - set(SamplingParams.__struct_fields__))
            if unknown:
                return f"SamplingParams has no field(s) {unknown}"
        elif path == "/collective_rpc":
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner
            from vllm.v1.worker.cpu_worker import CPUWorker

            from vllm.utils.import_utils import resolve_obj_by_qualname

            from areal_cli.inference.backends.vllm import WORKER_EXTENSION

            # the worker class vLLM builds has the launcher's --worker-extension-cls mixed in
            ext = resolve_obj_by_qualname(WORKER_EXTENSION)
            fn = getattr(CPUWorker, body["method"], None) or getattr(ext, body["method"], None)
            if fn is None:
                return f"the worker has no method {body['method']!r}"
            if getattr(ext, body["method"], None) is fn:  # the extension calls the worker's reload_weights
                inspect.signature(CPUModelRunner.reload_weights).bind(None, **body.get("kwargs", {}))
            params = inspect.signature(fn).parameters.values()
            if any(p.kind is p.VAR_KEYWORD for p in params):  # e.g. reload_weights: passed to the runner
                fn = getattr(CPUModelRunner, body["method"], fn)
            inspect.signature(fn).bind(None, *body.get("args", []), **body.get("kwargs", {}))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _calls(app, calls: dict) -> dict:
    from fastapi.exceptions import RequestValidationError
    from fastapi.testclient import TestClient

    # vLLM answers its routes' validation errors with 400, as it does some handler errors: record them
    # on the way to vLLM's own handler, which still answers.
    refused: list = []
    vllm_handler = app.exception_handlers[RequestValidationError]

    async def record(request, exc):
        refused.append(exc.errors())
        return await vllm_handler(request, exc)

    app.exception_handlers[RequestValidationError] = record
    app.middleware_stack = None  # built already (sagemaker bootstrap): rebuilt with the recorder
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no engine behind the routes
    out = {}
    for label, c in calls.items():
        route = _route(app, c["method"], c["path"])
        if route is None:
            out[label] = {"route": None}
            continue
        kw = {"params": c.get("params")}
        if c.get("json") is not None:
            kw["json"] = c["json"]
        refused.clear()
        resp = client.request(c["method"], c["path"], **kw)
        out[label] = {"route": route.path, "unknown": _unknown_fields(route, c.get("json")),
                      "status": resp.status_code, "refused": str(refused)[:600] if refused else None,
                      "nested": _nested(c["path"], c.get("json"))}
    return out


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.update(spec["env"])  # before vLLM reads them (vllm.envs reads os.environ lazily)
    from vllm.config import LoRAConfig
    from vllm.entrypoints.launchers.app import build_app

    res: dict = {"argv": {}, "ranks": {}}
    parsed = {}
    for label, argv in spec["argvs"].items():
        args, err = _parse(argv)
        parsed[label] = args
        res["argv"][label] = {"error": err}
    args = parsed[spec["engine_argv"]]
    res["engine"] = _engine_config(args) if args is not None else {"error": "argv refused"}
    for r in spec["ranks"]:
        try:
            res["ranks"][str(r)] = LoRAConfig(max_lora_rank=r).max_lora_rank
        except Exception as e:
            res["ranks"][str(r)] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    app = build_app(args, supported_tasks=("generate",))
    res["calls"] = _calls(app, spec["calls"])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
