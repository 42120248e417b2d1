"""How the LLM node's settings become its encoder channels' security, and which name verifies an encoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from encdis.llm_node.coordinator.channel_security import encoder_channel_security, verification_name
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from encdis.llm_node.settings import LLMSettings
from tests.certificates import TestPKI


def test_an_address_found_through_a_name_is_verified_against_the_name():
    assert verification_name({"encdis-encoder.encdis.svc.cluster.local:50051"}) == \
        "encdis-encoder.encdis.svc.cluster.local"
    assert verification_name({"10.0.0.7:50051"}) is None  # given by IP: verified against the IP
    assert verification_name({"[fd00::7]:50051"}) is None
    # Listed by an IP target and a name: the name (what its certificate is issued for).
    assert verification_name({"10.0.0.7:50051", "enc.example:50051"}) == "enc.example"
    assert verification_name({"b.example:1", "a.example:1"}) == "a.example"  # stable choice


def test_settings_become_channel_security(tmp_path: Path):
    pki = TestPKI(tmp_path)
    client = pki.issue("llm", client=True)
    key_file = tmp_path / "encoder-key"
    key_file.write_text("\nthe-encoder-key\n")
    assert encoder_channel_security(CoordinatorSettings(), environ={}) is None  # plaintext, no key

    s = CoordinatorSettings(encoder_tls_ca=pki.ca, encoder_tls_cert=client.cert, encoder_tls_key=client.key,
                            encoder_api_key_file=key_file)
    sec = encoder_channel_security(s, environ={})
    assert sec.tls and sec.root_certificates == pki.ca_pem
    assert (sec.certificate_chain, sec.private_key) == (client.cert_pem, client.key_pem)
    assert sec.api_key == "the-encoder-key"

    keyed = encoder_channel_security(CoordinatorSettings(), environ={"ENCDIS_ENCODER_API_KEY": "env-key"})
    assert not keyed.tls and keyed.api_key == "env-key"  # a key over plaintext (TLS ends in a mesh)
    with pytest.raises(ValueError, match="not both"):
        encoder_channel_security(s, environ={"ENCDIS_ENCODER_API_KEY": "env-key"})


def test_incomplete_encoder_tls_settings_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="--encoder-tls-cert and --encoder-tls-key go together"):
        CoordinatorSettings(encoder_tls_ca=tmp_path / "ca", encoder_tls_cert=tmp_path / "c")
    with pytest.raises(ValueError, match="--encoder-tls-cert needs --encoder-tls-ca"):
        CoordinatorSettings(encoder_tls_cert=tmp_path / "c", encoder_tls_key=tmp_path / "k")
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        LLMSettings(model="m", tls_client_ca=tmp_path / "ca")
