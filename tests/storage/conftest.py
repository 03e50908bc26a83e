"""The S3 fixtures of tests/integrations (a moto server on loopback), shared with the
storage tests so every storage runs the same suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_integration_fixtures", Path(__file__).resolve().parent.parent / "integrations" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

s3_endpoint = _fixtures.s3_endpoint
s3_options = _fixtures.s3_options
new_bucket = _fixtures.new_bucket
s3 = _fixtures.s3
