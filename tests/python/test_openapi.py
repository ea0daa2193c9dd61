"""/openapi.json is a valid OpenAPI 3 document (checked by openapi-spec-validator, an independent
implementation of the spec) and describes every route the server answers."""

import json
import urllib.request

from openapi_spec_validator import validate


def fetch(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def test_openapi_document_is_valid_and_complete(server_url):
    doc = fetch(f"{server_url}/openapi.json")
    validate(doc)
    described = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    for route in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/chat/completions/count"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{id}"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses"),
        ("GET", "/v1/responses/{id}"),
        ("DELETE", "/v1/responses/{id}"),
        ("POST", "/v1/responses/{id}/cancel"),
        ("GET", "/v1/responses/{id}/input_items"),
        ("GET", "/v1/stats"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/health"),
        ("GET", "/get_load"),
        ("GET", "/metrics"),
        ("POST", "/api/chat"),
        ("POST", "/api/generate"),
        ("POST", "/api/show"),
        ("GET", "/api/tags"),
        ("GET", "/api/ps"),
        ("GET", "/api/version"),
        ("POST", "/completion"),
        ("POST", "/infill"),
        ("GET", "/props"),
    ]:
        assert route in described, f"{route} is not in /openapi.json"
    # Every described GET without path parameters really answers (no stale entries).
    for method, path in described:
        if method == "GET" and "{" not in path and path != "/v1/responses":
            with urllib.request.urlopen(f"{server_url}{path}", timeout=10) as r:
                assert r.status == 200, path
