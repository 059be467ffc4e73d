"""Checks for ``s3://bucket/prefix`` paths through fsspec/s3fs.

Credentials and the endpoint come from the usual AWS sources (env, ~/.aws, instance role);
``AWS_ENDPOINT_URL`` or ``storage_options={"endpoint_url": ...}`` selects an S3-compatible
server (MinIO, Ceph RGW, moto).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from areal_cli.storage.report import FAIL, PASS, CheckResult, human_bytes

MULTIPART_CHUNK = 5 * 1024 * 1024  # S3's minimum part size


def _fs(storage_options: dict[str, Any] | None):
    import s3fs

    opts = dict(storage_options or {})
    ep = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("S3_ENDPOINT_URL")
    if ep:
        opts.setdefault("client_kwargs", {})["endpoint_url"] = ep
    # Fresh instance: s3fs caches instances by arguments, and a cached one may hold other credentials.
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **opts)


def _explain(e: BaseException) -> tuple[str, str]:
    """(figure, fix) for an S3 failure."""
    name = type(e).__name__
    text = str(e) or name
    low = (text + name).lower()
    if "nocredentials" in low or "unable to locate credentials" in low:
        return ("no credentials found",
                "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or attach an instance role")
    if any(k in low for k in ("invalidaccesskeyid", "signaturedoesnotmatch", "invalidclienttokenid",
                              "access key", "forbidden", "accessdenied", "permission")):
        return (f"credentials rejected: {text[:160]}",
                "check the access key/secret (and the endpoint), and that the user may read and write the bucket")
    if "nosuchbucket" in low or isinstance(e, FileNotFoundError):
        return (f"bucket not found: {text[:160]}", "create the bucket or fix the s3:// path")
    if "connect" in low or "endpoint" in low:
        return (f"cannot reach the endpoint: {text[:160]}", "check AWS_ENDPOINT_URL / network access")
    return (f"{name}: {text[:160]}", "check the bucket, credentials and endpoint")


def check_s3(url: str, storage_options: dict[str, Any] | None = None,
             multipart_bytes: int = MULTIPART_CHUNK + 1024) -> list[CheckResult]:
    """credentials, list, put, get, multipart upload, delete — stops at the first failure."""
    try:
        fs = _fs(storage_options)
    except ImportError:
        return [CheckResult("s3", FAIL, "s3fs is not installed", "pip install 'areal-cli[s3]'", path=url)]
    root = url[len("s3://"):].rstrip("/")
    bucket = root.split("/", 1)[0]
    base = f"{root}/.areal_storage_probe/{uuid.uuid4().hex}"
    out: list[CheckResult] = []

    def step(name: str, fn) -> Any:
        t = time.perf_counter()
        try:
            val = fn()
        except Exception as e:  # noqa: BLE001 - every S3 failure becomes a row with a fix
            fig, fix = _explain(e)
            out.append(CheckResult(name, FAIL, fig, fix, path=url))
            raise _Stop from e
        out.append(CheckResult(name, PASS, f"{(time.perf_counter() - t) * 1e3:.0f} ms", path=url))
        return val

    small = uuid.uuid4().bytes * 64
    try:
        step("s3 credentials", lambda: fs.ls(bucket, refresh=True))
        def list_prefix() -> None:
            try:
                fs.ls(root, refresh=True)
            except FileNotFoundError:
                pass  # a prefix that does not exist yet lists as empty; the bucket was found above

        step("s3 list", list_prefix)
        step("s3 put", lambda: fs.pipe_file(f"{base}/small", small))

        def get() -> None:
            got = fs.cat_file(f"{base}/small")
            if got != small:
                raise OSError(f"read back {len(got)} bytes that differ from the {len(small)} written")

        step("s3 get", get)
        big = os.urandom(multipart_bytes)

        def multipart() -> None:
            # block_size = part size: a write larger than one block goes through CreateMultipartUpload.
            with fs.open(f"{base}/multipart", "wb", block_size=MULTIPART_CHUNK) as f:
                for i in range(0, len(big), 1024 * 1024):
                    f.write(big[i:i + 1024 * 1024])
            size = fs.info(f"{base}/multipart", refresh=True)["size"]
            if size != len(big):
                raise OSError(f"multipart object has {size} bytes, wrote {len(big)}")

        step("s3 multipart upload", multipart)
        out[-1].figure += f" ({human_bytes(len(big))} in {-(-len(big) // MULTIPART_CHUNK)} parts)"

        def delete() -> None:
            fs.rm(base, recursive=True)
            fs.invalidate_cache()
            if fs.exists(f"{base}/small"):
                raise OSError("object still listed after delete")

        step("s3 delete", delete)
    except _Stop:
        try:
            fs.rm(base, recursive=True)
        except Exception:  # noqa: BLE001 - best-effort cleanup after a failed check
            pass
    return out


class _Stop(Exception):
    pass
