"""Fixtures of the series tests: the real moto S3 server of the integration tests, reused."""

from __future__ import annotations

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "fastckpt_integration_fixtures",
    pathlib.Path(__file__).parent.parent / "integrations" / "conftest.py",
)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

s3_endpoint = _fixtures.s3_endpoint
s3_options = _fixtures.s3_options
new_bucket = _fixtures.new_bucket
s3 = _fixtures.s3
