"""s3:// checks against a real S3-compatible HTTP server (moto in server mode, on a free port).

moto's auth emulation (INITIAL_NO_AUTH_ACTION_COUNT) mis-signs ListObjects requests whose query
carries a '/' (getmoto/moto#5948), which every prefix listing does, so the "works" case runs
against a server without auth enforcement and the credentials cases against one that enforces it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from areal_cli.storage import run_storage_check  # noqa: E402
from areal_cli.utils.network import find_free_port  # noqa: E402

BUCKET = "areal-bucket"


def _start_moto(env_extra: dict[str, str]):
    import httpx

    port = find_free_port()
    env = dict(os.environ, **env_extra)
    p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ep = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            httpx.get(ep + "/moto-api/", timeout=1.0)
            return p, ep
        except httpx.HTTPError:
            time.sleep(0.2)
    p.kill()
    pytest.fail("moto server did not start")


def _stop(p):
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()


@pytest.fixture(scope="module")
def open_s3():
    import boto3

    p, ep = _start_moto({})
    boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id="k",
                 aws_secret_access_key="s").create_bucket(Bucket=BUCKET)
    yield ep
    _stop(p)


@pytest.fixture(scope="module")
def auth_s3():
    """moto enforcing IAM: the first 4 calls (user, policy, attach, key) run unauthenticated."""
    import boto3

    p, ep = _start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    iam = boto3.client("iam", endpoint_url=ep, region_name="us-east-1", aws_access_key_id="x",
                       aws_secret_access_key="y")
    iam.create_user(UserName="areal")
    pol = iam.create_policy(PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    iam.attach_user_policy(UserName="areal", PolicyArn=pol["Policy"]["Arn"])
    key = iam.create_access_key(UserName="areal")["AccessKey"]
    boto3.client("s3", endpoint_url=ep, region_name="us-east-1", aws_access_key_id=key["AccessKeyId"],
                 aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket=BUCKET)
    yield ep, key
    _stop(p)


def test_s3_bucket_works(open_s3):
    import boto3

    opts = {"endpoint_url": open_s3, "key": "k", "secret": "s"}
    rep = run_storage_check([f"s3://{BUCKET}/runs"], s3_options=opts)
    names = [r.check for r in rep.results]
    assert names == ["s3 credentials", "s3 list", "s3 put", "s3 get", "s3 multipart upload", "s3 delete"]
    assert rep.ok, rep.summary()
    assert "2 parts" in rep.results[4].figure
    # The probe left nothing behind.
    s3 = boto3.client("s3", endpoint_url=open_s3, region_name="us-east-1", aws_access_key_id="k",
                      aws_secret_access_key="s")
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0


def test_s3_missing_bucket_fails(open_s3):
    rep = run_storage_check(["s3://no-such-bucket-areal/x"],
                            s3_options={"endpoint_url": open_s3, "key": "k", "secret": "s"})
    assert not rep.ok
    assert rep.results[0].check == "s3 credentials" and "bucket not found" in rep.results[0].figure


def test_s3_unknown_access_key_is_rejected(auth_s3):
    ep, _ = auth_s3
    rep = run_storage_check([f"s3://{BUCKET}/runs"],
                            s3_options={"endpoint_url": ep, "key": "AKIAAREALNOTAKEY000", "secret": "nope"})
    assert not rep.ok and len(rep.results) == 1
    r = rep.results[0]
    assert r.check == "s3 credentials" and r.status == "fail"
    assert "credentials rejected" in r.figure and "does not exist" in r.figure
    assert "access key" in r.fix


def test_s3_wrong_secret_is_rejected_but_right_one_can_write(auth_s3):
    import s3fs

    ep, key = auth_s3
    rep = run_storage_check([f"s3://{BUCKET}/runs"], s3_options={"endpoint_url": ep, "key": key["AccessKeyId"],
                                                                   "secret": "wrong-secret"})
    assert rep.results[0].status == "fail" and "signature" in rep.results[0].figure.lower()
    # Control: the real secret is accepted by the same server for object writes and reads.
    fs = s3fs.S3FileSystem(key=key["AccessKeyId"], secret=key["SecretAccessKey"],
                           client_kwargs={"endpoint_url": ep}, skip_instance_cache=True)
    fs.pipe_file(f"{BUCKET}/control", b"ok")
    assert fs.cat_file(f"{BUCKET}/control") == b"ok"


def test_s3_without_any_credentials(open_s3, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    rep = run_storage_check([f"s3://{BUCKET}/runs"], s3_options={"endpoint_url": open_s3})
    r = rep.results[0]
    assert r.status == "fail" and "no credentials" in r.figure and "AWS_ACCESS_KEY_ID" in r.fix
