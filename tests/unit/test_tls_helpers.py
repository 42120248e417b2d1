"""TLS helpers: flag checks, certificate files and their reload, and the HTTP front door's TLS.

Certificates are made at test time (tests/certificates.py). The HTTP tests serve a minimal
FastAPI app through the LLM node's real HttpFront (uvicorn) on loopback: what is under test
is its TLS (mTLS, reload) and the API key middleware, not the OpenAI routes (those run
against a real LLM node in tests/e2e/test_api_keys.py).
"""

from __future__ import annotations

import asyncio
import ssl

import pytest

from encdis.tls import CertificateFiles, ServerTLS, check_flags
from tests.certificates import TestPKI, replace_files, served_certificate
from tests.needs import require_module


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


def test_incomplete_flags_are_refused():
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        check_flags("cert.pem", None, None)
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        check_flags(None, "key.pem", None)
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        check_flags(None, None, "ca.pem")
    assert ServerTLS.from_flags(None, None, None) is None  # plaintext


def test_bad_files_are_named(pki, tmp_path):
    a = pki.issue("a", ips=["127.0.0.1"], directory=tmp_path)
    b = pki.issue("b", ips=["127.0.0.1"], directory=tmp_path)
    with pytest.raises(ValueError, match=f"--tls-cert {tmp_path / 'missing.pem'}"):
        ServerTLS.from_flags(tmp_path / "missing.pem", a.key, None)
    with pytest.raises(ValueError, match="--tls-key"):
        ServerTLS.from_flags(a.cert, b.key, None)  # a key that is not the certificate's
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-cert"):
        ServerTLS.from_flags(garbage, a.key, None)
    with pytest.raises(ValueError, match=f"--tls-client-ca {garbage}"):
        ServerTLS.from_flags(a.cert, a.key, garbage)
    assert ServerTLS.from_flags(a.cert, a.key, pki.ca) == ServerTLS(a.cert, a.key, pki.ca)


def test_reload_only_when_changed_and_whole(pki, tmp_path):
    live = pki.issue("live", ips=["127.0.0.1"], directory=tmp_path / "live")
    files = CertificateFiles(ServerTLS(live.cert, live.key))
    first = files.material
    assert files.reload_if_changed() is None  # nothing changed

    # Mid-rotation: the new certificate is there, its key not yet: keep serving the old pair.
    new = pki.issue("new", ips=["127.0.0.1"], directory=tmp_path / "new")
    tmp = live.cert.with_name("swap")
    tmp.write_bytes(new.cert_pem)
    tmp.replace(live.cert)
    assert files.reload_if_changed() is None
    assert files.material == first

    tmp.write_bytes(new.key_pem)
    tmp.replace(live.key)
    reloaded = files.reload_if_changed()
    assert reloaded is not None and reloaded.cert == new.cert_pem and reloaded.key == new.key_pem
    assert files.material == reloaded


async def _http_front(tls: ServerTLS, api_keys=None):
    require_module("uvicorn", "pip install 'encdis[llm-cpu]' (uvicorn comes with vLLM)")
    from fastapi import FastAPI

    from encdis.llm_node.http_front import HttpError, HttpFront, error_body

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    if api_keys is not None:
        from encdis.auth import HttpApiKeyMiddleware

        app.add_middleware(HttpApiKeyMiddleware, keys=api_keys, open_paths={"/health"},
                           error_body=lambda why: error_body(HttpError(401, why, "AuthenticationError")))
    front = HttpFront(app, "127.0.0.1", 0, tls=tls)
    port = await front.start()
    return front, port


def _client_ctx(ca, leaf=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if leaf is not None:
        ctx.load_cert_chain(leaf.cert, leaf.key)
    return ctx


async def test_https_requires_client_certificates_and_follows_the_files(pki, tmp_path):
    httpx = require_module("httpx", "pip install httpx (it comes with vLLM)")
    live = pki.issue("server", dns=["localhost"], ips=["127.0.0.1"], directory=tmp_path / "live")
    client = pki.issue("client", client=True)
    stranger = TestPKI(tmp_path / "stranger").issue("stranger", client=True)
    front, port = await _http_front(ServerTLS(live.cert, live.key, pki.ca))
    url = f"https://127.0.0.1:{port}/health"
    try:
        async with httpx.AsyncClient(verify=_client_ctx(pki.ca, client)) as http:
            assert (await http.get(url)).json() == {"status": "ok"}
        for ctx in (_client_ctx(pki.ca), _client_ctx(pki.ca, stranger)):  # no client cert; one nobody trusts
            async with httpx.AsyncClient(verify=ctx) as http:
                with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                    await http.get(url)
        async with httpx.AsyncClient() as http:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await http.get(f"http://127.0.0.1:{port}/health")  # plaintext to a TLS port

        # Rotation: new connections get the new certificate, without a restart (in a thread:
        # the server runs on this test's event loop).
        assert (await asyncio.to_thread(served_certificate, "127.0.0.1", port)).serial_number == live.serial()
        new = pki.issue("server-new", dns=["localhost"], ips=["127.0.0.1"], directory=tmp_path / "new")
        replace_files(new, live)
        assert (await asyncio.to_thread(served_certificate, "127.0.0.1", port)).serial_number == new.serial()
        async with httpx.AsyncClient(verify=_client_ctx(pki.ca, client)) as http:
            assert (await http.get(url)).status_code == 200
    finally:
        await front.stop()


async def test_http_api_key_middleware(pki, tmp_path):
    httpx = require_module("httpx", "pip install httpx (it comes with vLLM)")
    from encdis.auth import ApiKeys

    leaf = pki.issue("keyed", ips=["127.0.0.1"], directory=tmp_path)
    front, port = await _http_front(ServerTLS(leaf.cert, leaf.key), ApiKeys(["http-key"]))
    base = f"https://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(verify=_client_ctx(pki.ca)) as http:
            assert (await http.get(f"{base}/health")).status_code == 200  # open for probes
            for headers, why in (({}, "missing API key"), ({"Authorization": "Bearer nope"}, "invalid API key")):
                r = await http.get(f"{base}/v1/models", headers=headers)
                assert r.status_code == 401
                assert r.headers["www-authenticate"].startswith("Bearer")
                err = r.json()["error"]
                assert err["type"] == "AuthenticationError" and err["code"] == 401 and why in err["message"]
            r = await http.get(f"{base}/v1/models", headers={"Authorization": "Bearer http-key"})
            assert r.status_code == 200 and r.json() == {"data": []}
    finally:
        await front.stop()
