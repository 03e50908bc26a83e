"""Fixtures of the integration tests: a real S3 server (moto) on loopback, shared by the tests
of checkpoints at URLs (single files, sharded directories, DCP checkpoints)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server in this process, on a free loopback port (one for the session)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def s3_options(s3_endpoint) -> dict:
    """Storage options that reach the moto server."""
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": s3_endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


@pytest.fixture(scope="session")
def new_bucket(s3_options):
    """A function making a fresh bucket: ``new_bucket() -> (bucket URL, s3fs file system)``
    (for fixtures of a wider scope than one test)."""
    from fastckpt.integrations import remote

    def make() -> tuple[str, object]:
        fs, _ = remote.url_to_fs("s3://x", s3_options)
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        fs.call_s3("create_bucket", Bucket=bucket)
        return f"s3://{bucket}", fs

    return make


@pytest.fixture
def s3(s3_options, new_bucket):
    """(bucket URL, storage options, s3fs file system) for a fresh bucket."""
    url, fs = new_bucket()
    return url, s3_options, fs
