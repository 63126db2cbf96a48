"""A local moto S3 server for tests: `from tests.s3server import s3_server` in a conftest or test module."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

BUCKET = "memsnap-test"


@dataclass(frozen=True)
class S3Server:
    """Where the test server listens and the bucket it was given."""

    endpoint_url: str
    bucket: str
    region: str = "us-east-1"
    access_key: str = "testing"
    secret_key: str = "testing"

    def store_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for S3Store / S3Store.from_url."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
        }

    def client(self) -> Any:
        """A plain boto3 client for poking at the server directly."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )


@contextlib.contextmanager
def running_s3_server(bucket: str = BUCKET) -> Iterator[S3Server]:
    """Starts moto's S3 server on 127.0.0.1 with a free port, creates bucket, stops it on exit."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        info = S3Server(endpoint_url=f"http://{host}:{port}", bucket=bucket)
        info.client().create_bucket(Bucket=bucket)
        yield info
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A session-wide moto S3 server with one bucket; give each test its own key prefix."""
    with running_s3_server() as info:
        yield info
