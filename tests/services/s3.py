"""An S3-protocol server on 127.0.0.1: moto's server (``moto[server]``), started as its own
process and stopped by PID. It speaks real S3 HTTP (SigV4 signatures, multipart uploads with
S3's part-size rule, ranges) and keeps everything in memory: a restarted server is empty.
"""
from __future__ import annotations

import os
import sys
import urllib.request
from typing import Optional

from services import Proc, free_port, port_open, require_module

#: what the AWS chain must find in a test's environment: dummy credentials, a region, no
#: shared config files of the machine, no instance-metadata lookups
ENV = {
    "AWS_ACCESS_KEY_ID": "ucm-test",
    "AWS_SECRET_ACCESS_KEY": "ucm-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
#: variables that would override the dummy credentials above
UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
         "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
         "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE")


def moto_server(tmp, port: Optional[int] = None, name: str = "moto") -> Proc:
    """A started moto server; ``proc.port``, ``proc.url`` (the endpoint URL)."""
    require_module("boto3")
    require_module("moto.server")
    require_module("flask")  # moto[server]'s web stack: a plain ``moto`` install lacks it
    port = port or free_port()
    d = os.path.join(str(tmp), f"{name}-{port}")
    os.makedirs(d, exist_ok=True)
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = Proc(cmd, ready=lambda: _answers(port), env=ENV, log=os.path.join(d, "log"), name=name)
    proc.port = port
    proc.url = f"http://127.0.0.1:{port}"
    return proc.start()


def _answers(port: int) -> bool:
    if not port_open(port):
        return False
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1) as r:
        return r.status == 200


def client(url: str):
    """A plain boto3 client of the server (tests create buckets and tamper with objects)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, region_name=ENV["AWS_DEFAULT_REGION"],
                        aws_access_key_id=ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"],
                        config=Config(s3={"addressing_style": "path"},
                                      retries={"total_max_attempts": 1}))
